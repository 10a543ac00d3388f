//! The status page: one self-contained HTML file (page.html, no CDN) whose semaphore table is
//! rendered here, on the server, for the first paint and for every refresh (`GET /rows`, one
//! request for all semaphores). The page's script swaps the rows in, filters them by the search
//! box, and fetches one semaphore's holders and waiters (`/api/semaphores/{name}`) only while
//! its details are open. Every time is shown relative, in one format ([`crate::show::ago`]).

use std::fmt::Write as _;

use permitq::SemaphoreUsage;

use crate::show::Presence;

/// Where the rows go in page.html.
const ROWS_MARK: &str = "<!--rows-->";

/// The whole page with `usage` rendered into its table.
pub(crate) fn page(usage: &[SemaphoreUsage], presence: &Presence) -> String {
    include_str!("page.html").replacen(ROWS_MARK, &rows(usage, presence), 1)
}

/// The whole page when the database cannot be read: one row saying why.
pub(crate) fn page_unavailable(why: &str) -> String {
    let row = format!(
        "<tbody id=\"rows\"><tr class=\"none\"><td colspan=\"7\">cannot reach the database: {}</td></tr></tbody>",
        escape(why)
    );
    include_str!("page.html").replacen(ROWS_MARK, &row, 1)
}

/// The page's table body: the workers that run (or, marked, that nothing is granting), then one
/// row per semaphore, or one row saying there are none.
pub(crate) fn rows(usage: &[SemaphoreUsage], presence: &Presence) -> String {
    let mut html = String::from("<tbody id=\"rows\">");
    let _ = write!(
        html,
        "<tr class=\"{}\"><td colspan=\"7\">{}</td></tr>",
        if presence.nothing_granting.is_some() {
            "workers none"
        } else {
            "workers"
        },
        escape(&presence.summary())
    );
    if usage.is_empty() {
        html.push_str(
            "<tr class=\"none\"><td colspan=\"7\">no semaphores yet: \
             permitq semaphore set NAME CAPACITY</td></tr>",
        );
    }
    for u in usage {
        // A rate limit bounds grants in its window, not what is held: its bar is the window's
        // (as `top` draws it), so a window with room is not drawn full.
        let bounded = if u.per.is_some() { u.in_window } else { u.held };
        let pct = if u.capacity > 0 {
            (100 * bounded.clamp(0, u.capacity)) / u.capacity
        } else {
            100
        };
        let level = if bounded >= u.capacity {
            "full"
        } else if pct >= 75 {
            "busy"
        } else {
            "ok"
        };
        let oldest = if u.waiting > 0 {
            format!("{} ago", crate::show::ago(u.oldest_wait_since))
        } else {
            String::new()
        };
        let window = crate::show::window(u).unwrap_or_default();
        let mut kind: Vec<String> = [
            crate::show::origin(u.is_template, u.template.as_deref()),
            crate::show::nesting(u),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !u.fair {
            kind.push("greedy".to_string());
        }
        if let Some(a) = &u.adaptive {
            kind.push(format!("adaptive {}", a.algorithm.as_str()));
        }
        if u.fairness_keys {
            kind.push("by key".to_string());
        }
        let kind = kind.join(", ");
        let _ = write!(
            html,
            "<tr class=\"sem\" data-name=\"{name}\">\
             <td class=\"name\">{name}</td>\
             <td><div class=\"bar\" title=\"{bar_title}\"><div class=\"fill {level}\" style=\"width:{pct}%\"></div></div></td>\
             <td class=\"num\"><span class=\"held\">{held}</span> / <span class=\"capacity\">{capacity}</span></td>\
             <td class=\"num waiting\">{waiting}</td>\
             <td class=\"num\">{oldest}</td>\
             <td class=\"window\">{window}</td>\
             <td class=\"kind\">{kind}</td></tr>",
            name = escape(&u.name),
            bar_title = if u.per.is_some() {
                format!(
                    "{} of {} granted in its rate window",
                    u.in_window, u.capacity
                )
            } else {
                format!("{} of {} held", u.held, u.capacity)
            },
            held = u.held,
            capacity = u.capacity,
            waiting = u.waiting,
            oldest = escape(&oldest),
            window = escape(&window),
            kind = escape(&kind),
        );
    }
    html.push_str("</tbody>");
    html
}

/// `s` safe inside HTML text and double-quoted attributes.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_are_escaped() {
        assert_eq!(
            super::escape("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
