use super::*;

#[test]
fn rejects_zero_values_naming_the_field() {
    let err = Limit::fixed_window(0, Duration::from_secs(1)).unwrap_err();
    assert_eq!(err.field(), "limit");
    let err = Limit::fixed_window(1, Duration::ZERO).unwrap_err();
    assert_eq!(err.field(), "window");
    assert!(err.to_string().contains("window"), "{err}");
    let err = Limit::token_bucket(1, Duration::from_secs(1))
        .unwrap()
        .with_burst(0)
        .unwrap_err();
    assert_eq!(err.field(), "burst");
}

#[test]
fn rejects_sub_millisecond_windows_and_huge_limits() {
    assert!(Limit::fixed_window(1, Duration::from_micros(1500)).is_err());
    assert!(Limit::fixed_window(1, MAX_WINDOW + Duration::from_secs(1)).is_err());
    assert!(Limit::sliding_window(MAX_SLIDING_WINDOW_LIMIT + 1, Duration::from_secs(1)).is_err());
    assert_eq!(
        Limit::fixed_window(u32::MAX, MAX_WINDOW)
            .unwrap_err()
            .field(),
        "limit"
    );
    assert!(Limit::fixed_window(u32::MAX, Duration::from_secs(60)).is_ok());
}

#[test]
fn burst_only_for_buckets() {
    let err = Limit::fixed_window(5, Duration::from_secs(1))
        .unwrap()
        .with_burst(10)
        .unwrap_err();
    assert_eq!(err.field(), "burst");
}

#[test]
fn ids_name_every_parameter() {
    let a = Limit::token_bucket(5, Duration::from_secs(1)).unwrap();
    let b = a.clone().with_burst(6).unwrap();
    let c = Limit::gcra(5, Duration::from_secs(1)).unwrap();
    let d = a.clone().with_name("api").unwrap();
    assert_eq!(a.id(), "tb:5:1000:5");
    assert_eq!(b.id(), "tb:5:1000:6");
    assert_eq!(c.id(), "gcra:5:1000:5");
    assert_eq!(d.id(), "api:tb:5:1000:5");
    assert!(a.clone().with_name("a b").is_err());
}

#[test]
fn carried_over_ids_leave_out_limit_and_burst() {
    let a = Limit::token_bucket(5, Duration::from_secs(1))
        .unwrap()
        .with_name("api")
        .unwrap()
        .with_on_change(OnChange::CarryOver)
        .unwrap();
    let b = Limit::token_bucket(9, Duration::from_secs(1))
        .unwrap()
        .with_burst(20)
        .unwrap()
        .with_name("api")
        .unwrap()
        .with_on_change(OnChange::CarryOver)
        .unwrap();
    assert_eq!(a.id(), "api:tb:1000");
    assert_eq!(a.id(), b.id());
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_ne!(a.params_fingerprint(), b.params_fingerprint());
    assert_eq!(b.state_on_change(), OnChange::CarryOver);
    // A new window or algorithm is new state.
    let c = Limit::token_bucket(5, Duration::from_secs(2))
        .unwrap()
        .with_name("api")
        .unwrap()
        .with_on_change(OnChange::CarryOver)
        .unwrap();
    assert_ne!(a.id(), c.id());
    let err = Limit::per_second(1)
        .unwrap()
        .with_on_change(OnChange::CarryOver)
        .unwrap_err();
    assert_eq!(err.field(), "name");
    assert_eq!(
        "carry_over".parse::<OnChange>().unwrap(),
        OnChange::CarryOver
    );
    assert_eq!("keep".parse::<OnChange>().unwrap_err().field(), "on_change");
}

#[test]
fn lockouts_are_validated_and_keep_the_state() {
    let limit = Limit::fixed_window(5, Duration::from_secs(60)).unwrap();
    for bad in [
        Duration::ZERO,
        Duration::from_micros(1500),
        MAX_WINDOW + Duration::from_millis(1),
    ] {
        let err = limit.clone().with_lockout(bad).unwrap_err();
        assert_eq!(err.field(), "lockout", "{bad:?}");
    }
    let locked = limit
        .clone()
        .with_lockout(Duration::from_secs(900))
        .unwrap()
        .with_name("login")
        .unwrap()
        .with_on_change(OnChange::CarryOver)
        .unwrap();
    // Kept through the other builder calls; not part of the state's identity, but of
    // the parameters a cache of decisions tells apart.
    assert_eq!(locked.lockout(), Some(Duration::from_secs(900)));
    let plain = limit
        .with_name("login")
        .unwrap()
        .with_on_change(OnChange::CarryOver)
        .unwrap();
    assert_eq!(plain.lockout(), None);
    assert_eq!(locked.id(), plain.id());
    assert_ne!(locked.params_fingerprint(), plain.params_fingerprint());
    assert_ne!(locked, plain);
    // Two limits of one rule set that differ only in their lockout would share one
    // state: refused, naming the field.
    let err = crate::rules::Rules::new([locked.clone(), plain]).unwrap_err();
    assert_eq!(err.field(), "lockout");
    assert!(crate::rules::Rules::new([locked.clone(), locked]).is_ok());
}

#[test]
fn algorithm_names_round_trip() {
    for &algorithm in Algorithm::ALL {
        assert_eq!(algorithm.as_str().parse::<Algorithm>().unwrap(), algorithm);
    }
    assert_eq!(
        "leaky".parse::<Algorithm>().unwrap_err().field(),
        "algorithm"
    );
}
