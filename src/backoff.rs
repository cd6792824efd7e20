//! [`Backoff`]: a pause that doubles after each try, up to a bound. Every
//! loop that tries again (connecting at start, a consumer reconnecting, the
//! database probe, immediate retries) takes its pauses from one.

use std::time::Duration;

/// Pauses that double after each try, up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `first`, doubles up to `max`.
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            next: first.min(max),
            max,
        }
    }

    /// The pause before the next try; the one after is twice as long.
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        pause
    }

    /// The pause before try number `n` (from 0), without keeping count.
    pub fn nth(first: Duration, n: u32, max: Duration) -> Duration {
        first.saturating_mul(1 << n.min(31)).min(max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_its_bound() {
        let ms = Duration::from_millis;
        let mut backoff = Backoff::new(ms(100), ms(500));
        let pauses: Vec<_> = (0..5).map(|_| backoff.next_pause()).collect();
        assert_eq!(pauses, [ms(100), ms(200), ms(400), ms(500), ms(500)]);
        assert_eq!(Backoff::nth(ms(100), 2, Duration::MAX), ms(400));
        assert_eq!(Backoff::nth(ms(100), u32::MAX, ms(500)), ms(500));
    }
}
