use super::*;
use crate::LimitDecision;

fn store() -> Guarded {
    Guarded::new(Arc::new(crate::store::MemoryStore::new()), None, None)
}

fn denied(retry_after_ms: u64) -> Decision {
    Decision::new(vec![LimitDecision::deny(5, 0, 1_000, retry_after_ms)])
}

#[test]
fn only_the_latest_reservation_of_a_key_is_the_last() {
    let waiting = Arc::new(Waiting::new(Arc::default(), Duration::from_secs(1), 10, 10));
    let (a, b) = (Key::new("a"), Key::new("b"));
    let reserved = Decision::new(vec![LimitDecision::allow(1, 0, 100)]).with_wait(50);
    let place = |key: &Key| match waiting.admit_reserved(&store(), false, key, reserved.clone()) {
        Ok(ticket) => ticket.place,
        Err(_) => panic!("a place for {key:?}"),
    };
    let (mut first, mut second, mut other) = (place(&a), place(&a), place(&b));
    assert!(!waiting.none_reserved(&a));
    // "first" is not the latest of "a" ("second" is); "b" has its own line.
    assert!(!first.leave_reserved());
    assert!(other.leave_reserved());
    assert!(second.leave_reserved());
    assert!(!second.leave_reserved(), "once");
    assert!(waiting.none_reserved(&a));
    // A refused reservation is a denial with its wait as the retry.
    let denied = refused(&reserved);
    assert!(!denied.is_allowed());
    assert_eq!(denied.retry_after(), Duration::from_millis(50));
    drop((first, second, other));
    assert_eq!(waiting.len(), 0);
    assert!(waiting.queue.per_key.lock().is_empty());
}

#[test]
fn places_are_bounded_and_given_back() {
    let waiting = Arc::new(Waiting::new(Arc::default(), Duration::from_secs(1), 3, 2));
    let limits = [Limit::fixed_window(5, Duration::from_secs(1)).unwrap()];
    let (a, b) = (Key::new("a"), Key::new("b"));
    let store = store();
    let admit = |key: &Key, retry| waiting.admit(&store, false, key, &limits, 1, &denied(retry));
    // Only a wait within max_wait, and never for a request that cannot fit.
    assert!(admit(&a, 1_001).is_none());
    assert!(
        waiting
            .admit(&store, false, &a, &limits, 6, &denied(10))
            .is_none()
    );
    let a1 = admit(&a, 1_000).unwrap();
    let a2 = admit(&a, 10).unwrap();
    assert!(admit(&a, 10).is_none(), "two per key");
    let b1 = admit(&b, 10).unwrap();
    assert!(admit(&b, 10).is_none(), "three per layer");
    assert_eq!(waiting.len(), 3);
    drop(a1);
    assert_eq!(waiting.len(), 2);
    let b2 = admit(&b, 10).unwrap();
    drop((a2, b1, b2));
    assert_eq!(waiting.len(), 0);
    assert!(waiting.queue.per_key.lock().is_empty());
}
