//! [`Backoff`]: a pause that doubles after each try, up to a bound, drawn
//! at random below it. Every loop that tries again (connecting at start, a
//! consumer reconnecting, the database probe, the outbox's LISTEN, the
//! migration lock) takes its pauses from one, and the outbox's retries of
//! a row are drawn with [`Backoff::jitter`].
//!
//! Why the randomness: after a broker or database restart, every link of
//! every replica starts retrying at the same instant, and with fixed pauses
//! they would go on hitting the server together, try after try. Each pause
//! is drawn between half and all of its value ("equal jitter"), so the
//! bounds the settings and docs give stay bounds.

use std::time::Duration;

/// Pauses that double after each try, up to `max`, each drawn between half
/// and all of that value.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Starts at `first`, doubles up to `max`.
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Self {
            next: first.min(max),
            max,
        }
    }

    /// The pause before the next try, drawn between half and all of its
    /// value; the next value is twice as long.
    pub(crate) fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = self.next.saturating_mul(2).min(self.max);
        Self::jitter(pause)
    }

    /// The value of the pause before try number `n` (from 0), without
    /// keeping count and without jitter: `first` doubled `n` times, at most
    /// `max`.
    pub(crate) fn nth(first: Duration, n: u32, max: Duration) -> Duration {
        first.saturating_mul(1 << n.min(31)).min(max)
    }

    /// `pause` drawn at random between its half and itself, from the
    /// thread's generator (`fastrand::seed` makes a test's draws exact).
    pub(crate) fn jitter(pause: Duration) -> Duration {
        let half = pause / 2;
        half + (pause - half).mul_f64(fastrand::f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_its_bound_each_pause_drawn_between_half_and_all_of_it() {
        let ms = Duration::from_millis;
        let values = [ms(100), ms(200), ms(400), ms(500), ms(500)];
        fastrand::seed(7);
        let mut backoff = Backoff::new(ms(100), ms(500));
        let pauses: Vec<_> = values.iter().map(|_| backoff.next_pause()).collect();
        // The same seed, the same draws: exact.
        fastrand::seed(7);
        let expected: Vec<_> = values
            .iter()
            .map(|&v| v / 2 + (v - v / 2).mul_f64(fastrand::f64()))
            .collect();
        assert_eq!(pauses, expected);
        for (pause, value) in pauses.iter().zip(values) {
            assert!(*pause >= value / 2 && *pause <= value, "{pause:?} for {value:?}");
        }
        assert_eq!(Backoff::nth(ms(100), 2, Duration::MAX), ms(400));
        assert_eq!(Backoff::nth(ms(100), u32::MAX, ms(500)), ms(500));
    }

    #[test]
    fn two_replicas_retrying_after_one_restart_do_not_pause_in_lockstep() {
        let second = Duration::from_secs(1);
        let draws = |seed| {
            fastrand::seed(seed);
            let mut backoff = Backoff::new(second, 30 * second);
            (0..8).map(|_| backoff.next_pause()).collect::<Vec<_>>()
        };
        let (one, other) = (draws(1), draws(2));
        assert!(one.iter().zip(&other).all(|(a, b)| a != b), "{one:?} {other:?}");
    }
}
