//! Answers read from the database, reused for a short while: however many clients ask (status
//! pages, scrapes, API calls, probes), the database is read at most once per period per answer.
//! One caller reads; the others wait for its answer and share it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

/// One answer, read again once it is older than the period.
pub(super) struct Reused<T> {
    period: Duration,
    last: Mutex<Option<(Instant, T)>>,
}

impl<T: Clone> Reused<T> {
    /// Reuses each answer for `period`.
    pub(super) fn new(period: Duration) -> Self {
        Self {
            period,
            last: Mutex::new(None),
        }
    }

    /// Whether it holds an answer younger than the period (or is being read right now).
    fn is_fresh(&self) -> bool {
        self.last.try_lock().map_or(true, |last| {
            last.as_ref()
                .is_some_and(|(at, _)| at.elapsed() < self.period)
        })
    }

    /// The last answer if it is fresh, else `read`'s (callers meanwhile wait for it).
    pub(super) async fn get<F: Future<Output = T>>(&self, read: impl FnOnce() -> F) -> T {
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = last.as_ref() {
            if at.elapsed() < self.period {
                return answer.clone();
            }
        }
        let answer = read().await;
        *last = Some((Instant::now(), answer.clone()));
        answer
    }
}

/// One answer per key (a semaphore's name), each a [`Reused`] of its own: reads of one key are
/// shared, reads of different keys run side by side (the server's request limit bounds them).
/// Answers past the period are dropped at every lookup, so only keys asked for lately are kept.
pub(super) struct ReusedByKey<T> {
    period: Duration,
    answers: std::sync::Mutex<HashMap<String, Arc<Reused<T>>>>,
}

impl<T: Clone> ReusedByKey<T> {
    /// Reuses each key's answer for `period`.
    pub(super) fn new(period: Duration) -> Self {
        Self {
            period,
            answers: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// `key`'s last answer if it is fresh, else `read`'s (callers of the same key meanwhile
    /// wait for it; other keys do not).
    pub(super) async fn get<F: Future<Output = T>>(
        &self,
        key: &str,
        read: impl FnOnce() -> F,
    ) -> T {
        let reused = {
            let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
            // Kept: those being read or waited on, and fresh answers.
            answers.retain(|_, r| Arc::strong_count(r) > 1 || r.is_fresh());
            answers
                .entry(key.to_string())
                .or_insert_with(|| Arc::new(Reused::new(self.period)))
                .clone()
        };
        reused.get(read).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn callers_within_the_period_share_one_read() {
        let reused = Arc::new(Reused::new(Duration::from_secs(60)));
        let reads = Arc::new(AtomicUsize::new(0));
        let callers = (0..20).map(|_| {
            let (reused, reads) = (reused.clone(), reads.clone());
            tokio::spawn(async move {
                reused
                    .get(|| async {
                        tokio::task::yield_now().await;
                        reads.fetch_add(1, Ordering::SeqCst)
                    })
                    .await
            })
        });
        for caller in callers {
            assert_eq!(caller.await.unwrap(), 0, "every caller got the first read");
        }
        assert_eq!(reads.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_answer_past_its_period_is_read_again_and_old_keys_are_dropped() {
        let reused = Reused::new(Duration::ZERO);
        assert_eq!(reused.get(|| async { 1 }).await, 1);
        assert_eq!(reused.get(|| async { 2 }).await, 2);
        let by_key = ReusedByKey::new(Duration::from_secs(60));
        assert_eq!(by_key.get("a", || async { 1 }).await, 1);
        assert_eq!(by_key.get("a", || async { 2 }).await, 1, "fresh: reused");
        assert_eq!(by_key.get("b", || async { 3 }).await, 3, "another key");
        let by_key = ReusedByKey::new(Duration::ZERO);
        by_key.get("a", || async { 1 }).await;
        by_key.get("b", || async { 2 }).await;
        assert_eq!(by_key.answers.lock().unwrap().len(), 1, "a was dropped");
    }
}
