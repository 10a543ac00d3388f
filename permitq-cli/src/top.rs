//! `permitq top`: a live terminal view of a database, like `htop` for semaphores.
//!
//! Every semaphore with a bar and use/capacity (permits held, `#`; for a rate limit, grants in its
//! current window, `=`, since a rate limit bounds grants, not holders), waiting, oldest wait, grants
//! per second and its kind (template, instance, rate window; cut to fit, ending in `..`), and the
//! workers that run (or that none does); ↑/↓ (or j/k) select one, Enter shows its whole kind,
//! holders and waiters (in place-in-line order, with priorities) below, and Enter or Esc closes
//! them; `q` (or Esc, Ctrl-C) quits.
//! Plain ASCII-safe drawing that fits 80×24 and works over SSH.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use permitq::{Client, Holder, SemaphoreUsage, Waiter};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Table, TableState, Wrap};
use ratatui::{DefaultTerminal, Frame};

use crate::error::{CliError, Result};
use crate::show::ago;

/// Waiters listed for the selected semaphore.
const WAITERS_SHOWN: i64 = 50;

/// What is on screen.
#[derive(Default)]
struct View {
    usage: Vec<SemaphoreUsage>,
    /// Grants per second since the previous refresh, by semaphore.
    rates: HashMap<String, f64>,
    table: TableState,
    detail: bool,
    holders: Vec<Holder>,
    waiters: Vec<Waiter>,
    /// For a semaphore served by fairness key: its keys that wait, with their weights and
    /// shares of the turns to come (on the detail's kind line, which has the whole width).
    keys: String,
    error: Option<String>,
    /// When the rows shown were read (the last refresh that reached the database).
    read_at: Option<std::time::SystemTime>,
    /// The workers line (or that nothing is granting).
    workers: String,
    /// For an adaptive semaphore selected: its last capacities, oldest first, and what moved
    /// the last one.
    trace: String,
}

/// Runs until the user quits.
pub(crate) async fn run(client: Client, interval: Duration) -> Result<()> {
    // A refusal that retrying cannot mend (no permitq role, no schema) is said in full, before
    // the screen is drawn; a database that does not answer is shown and retried.
    if let Err(e) = client.usage().await {
        if !e.is_retryable() {
            return Err(e.into());
        }
    }
    let mut terminal = ratatui::try_init()
        .map_err(|e| CliError::runtime(format!("cannot set up the terminal: {e}")))?;
    let result = event_loop(&mut terminal, &client, interval).await;
    let _ = ratatui::try_restore();
    result
}

/// Refuses to start without an interactive terminal, saying what to use instead.
pub(crate) fn check_terminal() -> Result<()> {
    use std::io::IsTerminal as _;
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        return Err(CliError::runtime(
            "`permitq top` draws on an interactive terminal, and this is not one: for a \
             snapshot use `permitq semaphore list` or `permitq semaphore show NAME` (--json for \
             scripts), or `permitq serve` for a page",
        ));
    }
    Ok(())
}

async fn event_loop(
    terminal: &mut DefaultTerminal,
    client: &Client,
    interval: Duration,
) -> Result<()> {
    let mut view = View::default();
    let mut previous: Option<(Instant, HashMap<String, i64>)> = None;
    loop {
        refresh(client, &mut view, &mut previous).await;
        terminal
            .draw(|frame| draw(frame, &mut view))
            .map_err(|e| CliError::runtime(format!("cannot draw: {e}")))?;
        let next = Instant::now() + interval;
        // Keys until the next refresh (redrawn at once after a key).
        while let Some(left) = next.checked_duration_since(Instant::now()) {
            let key = tokio::task::block_in_place(|| -> std::io::Result<Option<Event>> {
                if event::poll(left)? {
                    event::read().map(Some)
                } else {
                    Ok(None)
                }
            })
            .map_err(|e| CliError::runtime(format!("cannot read the terminal: {e}")))?;
            let Some(Event::Key(key)) = key else { continue };
            if key.kind != KeyEventKind::Press {
                continue;
            }
            match key.code {
                KeyCode::Char('q') => return Ok(()),
                KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => {
                    return Ok(())
                }
                KeyCode::Esc if !view.detail => return Ok(()),
                KeyCode::Esc => view.detail = false,
                KeyCode::Down | KeyCode::Char('j') => view.table.select_next(),
                KeyCode::Up | KeyCode::Char('k') => view.table.select_previous(),
                KeyCode::Enter => {
                    view.detail = !view.detail;
                    break; // fetch the holders and waiters now
                }
                _ => {}
            }
            terminal
                .draw(|frame| draw(frame, &mut view))
                .map_err(|e| CliError::runtime(format!("cannot draw: {e}")))?;
        }
    }
}

async fn refresh(
    client: &Client,
    view: &mut View,
    previous: &mut Option<(Instant, HashMap<String, i64>)>,
) {
    match client.usage().await {
        Ok(usage) => {
            let now = Instant::now();
            let counts: HashMap<String, i64> =
                usage.iter().map(|s| (s.name.clone(), s.granted)).collect();
            if let Some((then, before)) = previous.as_ref() {
                let secs = now.duration_since(*then).as_secs_f64().max(0.001);
                view.rates = counts
                    .iter()
                    .map(|(name, n)| {
                        let delta = n - before.get(name).copied().unwrap_or(*n);
                        #[allow(clippy::cast_precision_loss, reason = "a rate to show")]
                        (name.clone(), delta.max(0) as f64 / secs)
                    })
                    .collect();
            }
            *previous = Some((now, counts));
            view.usage = usage;
            view.error = None;
            view.read_at = Some(std::time::SystemTime::now());
            if view.table.selected().is_none() && !view.usage.is_empty() {
                view.table.select(Some(0));
            }
        }
        Err(e) => view.error = Some(crate::error::one_line(&e.to_string())),
    }
    view.workers = match crate::show::Presence::read(client).await {
        Ok(presence) => presence.short_summary(),
        Err(e) => format!("workers: {}", crate::error::one_line(&e.to_string())),
    };
    let selected = view
        .table
        .selected()
        .and_then(|i| view.usage.get(i.min(view.usage.len().saturating_sub(1))))
        .map(|s| s.name.clone());
    if let (true, Some(name)) = (view.detail, selected) {
        let adaptive = view
            .usage
            .iter()
            .any(|u| u.name == name && u.adaptive.is_some());
        view.trace = if adaptive {
            let history = client.capacity_history(&name).await.unwrap_or_default();
            let last = &history[history.len().saturating_sub(12)..];
            let capacities: Vec<String> = last.iter().map(|c| c.new_capacity.to_string()).collect();
            // The last cadence's reports (a setting's change has none).
            let moved = last
                .iter()
                .rev()
                .filter_map(|c| c.inputs.as_ref())
                .find(|i| i.get("ok").is_some())
                .map_or(String::new(), |i| {
                    format!(
                        " (last: {} ok, {} overloaded)",
                        i["ok"].as_i64().unwrap_or(0),
                        i["overloaded"].as_i64().unwrap_or(0)
                    )
                });
            format!("capacity {}{moved}", capacities.join(" "))
        } else {
            String::new()
        };
        view.holders = client.holders(&name).await.unwrap_or_default();
        view.waiters = client
            .waiters(&name, WAITERS_SHOWN)
            .await
            .unwrap_or_default();
        let keyed = view.usage.iter().any(|u| u.name == name && u.fairness_keys);
        view.keys = if keyed {
            let keys: Vec<String> = client
                .key_shares(&name)
                .await
                .unwrap_or_default()
                .iter()
                .filter(|k| k.waiting > 0)
                // Each key's share of the turns to come, as `semaphore show` gives it (none for
                // a producer login, which sees its own keys alone).
                .map(|k| {
                    format!(
                        "{} {}×w{}{}",
                        crate::show::key_label(k),
                        k.waiting,
                        k.weight,
                        k.share_percent
                            .map_or(String::new(), |share| format!(" {share}%"))
                    )
                })
                .collect();
            format!("turns by key: {}", keys.join(", "))
        } else {
            String::new()
        };
    }
}

/// The first line: what the keys do; or, while the database does not answer, that the rows are
/// the last ones read and when (first, so that 80 columns show it), then why.
fn header_line(view: &View) -> String {
    match (&view.error, view.read_at) {
        (Some(e), Some(at)) => {
            let at = humantime::format_rfc3339_seconds(at).to_string();
            format!(
                "permitq top  UNREACHABLE, rows as of {} UTC (retrying): {e}",
                at.get(11..19).unwrap_or(&at)
            )
        }
        (Some(e), None) => format!("permitq top  UNREACHABLE (retrying): {e}"),
        (None, _) if view.detail => format!(
            "permitq top  {} semaphores  q quit  up/down select  enter or esc: back",
            view.usage.len()
        ),
        (None, _) => format!(
            "permitq top  {} semaphores  q quit  up/down select  enter: holders, waiters",
            view.usage.len()
        ),
    }
}

/// `[#####.....]` for `used` of `capacity`, `width` cells inside the brackets, filled with `fill`.
fn bar(used: i64, capacity: i64, width: usize, fill: &str) -> String {
    let filled = if capacity <= 0 {
        width
    } else {
        let ratio = used.clamp(0, capacity) as f64 / capacity as f64;
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "0..=width"
        )]
        let cells = (ratio * width as f64).round() as usize;
        cells.min(width)
    };
    format!("[{}{}]", fill.repeat(filled), ".".repeat(width - filled))
}

/// The lines `text` takes wrapped at word boundaries to `width` columns (at least 1).
fn wrapped_height(text: &str, width: u16) -> u16 {
    let width = usize::from(width.max(1));
    let mut lines = 1u16;
    let mut used = 0;
    for word in text.split_whitespace() {
        let len = word.chars().count();
        if used > 0 && used + 1 + len > width {
            lines = lines.saturating_add(1);
            used = 0;
        }
        // A word longer than the line takes as many lines as it fills.
        let whole = len.div_ceil(width).max(1);
        lines = lines.saturating_add(u16::try_from(whole - 1).unwrap_or(u16::MAX));
        used = if used == 0 {
            len - (whole - 1) * width
        } else {
            used + 1 + len
        };
    }
    lines
}

fn draw(frame: &mut Frame, view: &mut View) {
    let detail_height = if view.detail { 11 } else { 0 };
    // The workers line wraps: that nothing is granting, and what to do, is said whole.
    let workers_height = wrapped_height(&view.workers, frame.area().width).min(6);
    let [header, workers, list, detail] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(workers_height),
        Constraint::Min(3),
        Constraint::Length(detail_height),
    ])
    .areas(frame.area());
    frame.render_widget(Line::from(header_line(view)), header);
    frame.render_widget(
        Paragraph::new(view.workers.as_str()).wrap(Wrap { trim: true }),
        workers,
    );

    // The name column as wide as the longest name (9 to 20); the kind column takes the rest
    // (the others and their gaps take 42), and a kind cut to fit ends in `..`: Enter shows it whole.
    let name_width = view
        .usage
        .iter()
        .map(|s| s.name.chars().count())
        .max()
        .unwrap_or(0)
        .clamp(9, 20);
    let kind_width = usize::from(list.width).saturating_sub(42 + name_width);
    let rows = view.usage.iter().map(|s| {
        Row::new(vec![
            cut(&s.name, name_width),
            // A rate limit bounds grants per window, not holders: its bar is the window's, drawn
            // with `=` so that it does not read as permits held.
            bar(
                shown(s),
                s.capacity,
                8,
                if s.per.is_some() { "=" } else { "#" },
            ),
            format!("{}/{}", shown(s), s.capacity),
            s.waiting.to_string(),
            if s.waiting > 0 {
                ago(s.oldest_wait_since)
            } else {
                "-".to_string()
            },
            format!("{:.1}", view.rates.get(&s.name).copied().unwrap_or(0.0)),
            cut(&crate::show::short_kind(s), kind_width),
        ])
    });
    let table = Table::new(
        rows,
        [
            #[allow(clippy::cast_possible_truncation, reason = "at most 20")]
            Constraint::Length(name_width as u16),
            Constraint::Length(10),
            Constraint::Length(9),
            Constraint::Length(4),
            Constraint::Length(6),
            Constraint::Length(7),
            Constraint::Fill(1),
        ],
    )
    .header(
        Row::new([
            "semaphore",
            "use",
            "use/cap",
            "wait",
            "oldest",
            "grant/s",
            "kind",
        ])
        .style(Style::new().add_modifier(Modifier::BOLD)),
    )
    .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED))
    .block(Block::new().borders(Borders::TOP));
    frame.render_stateful_widget(table, list, &mut view.table);

    if view.detail {
        // The selected semaphore's whole kind: the column above may have cut it.
        let [kind_line, detail] =
            Layout::vertical([Constraint::Length(1), Constraint::Min(1)]).areas(detail);
        if let Some(s) = view.table.selected().and_then(|i| view.usage.get(i)) {
            let children: Vec<&str> = view
                .usage
                .iter()
                .filter(|c| c.parent.as_deref() == Some(s.name.as_str()))
                .map(|c| c.name.as_str())
                .collect();
            let kind = [
                crate::show::kind(s),
                if children.is_empty() {
                    String::new()
                } else {
                    format!("parent of {}", children.join(", "))
                },
                if s.adaptive.is_some() {
                    view.trace.clone()
                } else {
                    String::new()
                },
                view.keys.clone(),
            ]
            .into_iter()
            .filter(|k| !k.is_empty())
            .collect::<Vec<_>>()
            .join("; ");
            let kind = if kind.is_empty() {
                "plain semaphore".to_string()
            } else {
                kind
            };
            frame.render_widget(Line::from(format!("{}: {kind}", s.name)), kind_line);
        }
        let [holders, waiters] =
            Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)])
                .areas(detail);
        let holder_rows = view.holders.iter().map(|h| {
            Row::new(vec![
                h.external_id.clone(),
                h.count.to_string(),
                ago(h.acquired_at),
            ])
        });
        frame.render_widget(
            Table::new(
                holder_rows,
                [
                    Constraint::Min(10),
                    Constraint::Length(6),
                    Constraint::Length(8),
                ],
            )
            .header(
                Row::new(["holder", "count", "held"])
                    .style(Style::new().add_modifier(Modifier::BOLD)),
            )
            .block(
                Block::new()
                    .borders(Borders::TOP)
                    .title(format!(" holders ({}) ", view.holders.len())),
            ),
            holders,
        );
        let waiter_rows = view.waiters.iter().map(|w| {
            Row::new(vec![
                w.position.to_string(),
                w.external_id.clone(),
                w.count.to_string(),
                w.priority.to_string(),
                ago(w.waiting_since),
            ])
        });
        frame.render_widget(
            Table::new(
                waiter_rows,
                [
                    Constraint::Length(4),
                    Constraint::Min(10),
                    Constraint::Length(6),
                    Constraint::Length(4),
                    Constraint::Length(8),
                ],
            )
            .header(
                Row::new(["pos", "waiter", "count", "pri", "waiting"])
                    .style(Style::new().add_modifier(Modifier::BOLD)),
            )
            .block(
                Block::new()
                    .borders(Borders::TOP)
                    .title(format!(" waiters ({}) ", view.waiters.len())),
            ),
            waiters,
        );
    }
}

/// `text` in at most `width` characters: cut, ending in `..` (ASCII), when longer.
fn cut(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let mut short: String = text.chars().take(width.saturating_sub(2)).collect();
    short.push_str(&"..".chars().take(width).collect::<String>());
    short
}

/// What the held column shows: permits held, or for a rate limit the grants in its window.
fn shown(s: &permitq::SemaphoreUsage) -> i64 {
    if s.per.is_some() {
        s.in_window
    } else {
        s.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapped_height_counts_the_lines_of_a_word_wrap() {
        assert_eq!(wrapped_height("", 80), 1);
        assert_eq!(wrapped_height("one two", 7), 1);
        assert_eq!(wrapped_height("one two", 6), 2);
        assert_eq!(wrapped_height("abcdefghij", 4), 3);
        assert_eq!(wrapped_height("ab abcdefghij", 4), 4);
    }

    #[test]
    fn while_the_database_is_down_the_header_says_the_rows_are_old_and_from_when() {
        let mut view = View {
            read_at: Some(std::time::UNIX_EPOCH + Duration::from_secs(45_296)),
            error: Some("cannot reach PostgreSQL at localhost:5432".into()),
            ..View::default()
        };
        let line = header_line(&view);
        assert!(
            line.starts_with(
                "permitq top  UNREACHABLE, rows as of 12:34:56 UTC (retrying): cannot reach"
            ),
            "{line}"
        );
        view.error = None;
        assert!(header_line(&view).contains("q quit"));
        view.detail = true;
        assert!(header_line(&view).contains("enter or esc: back"));
    }

    #[test]
    fn a_cut_text_ends_in_two_dots_and_fits() {
        assert_eq!(cut("in pool; per 1h", 20), "in pool; per 1h");
        assert_eq!(cut("template; in shared-pool; per 1h", 12), "template; ..");
        assert_eq!(
            (cut("abc", 1), cut("abc", 0)),
            (".".to_string(), String::new())
        );
    }
}
