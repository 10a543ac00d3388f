//! Answers read from the database, reused for a short while: however many clients ask (status
//! pages, scrapes, API calls, probes), the database is read at most once per period per answer.
//! One caller reads; the others wait for its answer and share it.

use std::collections::HashMap;
use std::future::Future;
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

/// One answer per key (a semaphore's name), each as [`Reused`]; answers older than the period
/// are dropped at every read, so only keys asked for lately are kept.
pub(super) struct ReusedByKey<T> {
    period: Duration,
    answers: Mutex<HashMap<String, (Instant, T)>>,
}

impl<T: Clone> ReusedByKey<T> {
    /// Reuses each key's answer for `period`.
    pub(super) fn new(period: Duration) -> Self {
        Self {
            period,
            answers: Mutex::new(HashMap::new()),
        }
    }

    /// `key`'s last answer if it is fresh, else `read`'s. Reads of different keys take turns:
    /// the whole API reads the database one answer at a time.
    pub(super) async fn get<F: Future<Output = T>>(
        &self,
        key: &str,
        read: impl FnOnce() -> F,
    ) -> T {
        let mut answers = self.answers.lock().await;
        answers.retain(|_, (at, _)| at.elapsed() < self.period);
        if let Some((_, answer)) = answers.get(key) {
            return answer.clone();
        }
        let answer = read().await;
        answers.insert(key.to_string(), (Instant::now(), answer.clone()));
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

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
        assert_eq!(by_key.answers.lock().await.len(), 1, "a was dropped");
    }
}
