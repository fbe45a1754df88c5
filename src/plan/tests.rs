use super::*;

fn limit(n: u32) -> Limit {
    Limit::fixed_window(n, Duration::from_secs(60)).unwrap()
}

#[test]
fn invalid_plans_name_their_field() {
    assert_eq!(Plan::new("", [limit(1)]).unwrap_err().field(), "plan");
    assert_eq!(Plan::new("a b", [limit(1)]).unwrap_err().field(), "plan");
    assert_eq!(Plan::new("free", []).unwrap_err().field(), "limits");
    assert_eq!(Plans::new([]).unwrap_err().field(), "plans");
    let twice = Plans::new([
        Plan::new("a", [limit(1)]).unwrap(),
        Plan::unlimited("a").unwrap(),
    ]);
    assert_eq!(twice.unwrap_err().field(), "plans");
    let plans = Plans::new([Plan::unlimited("a").unwrap()]).unwrap();
    assert_eq!(plans.with_default("b").unwrap_err().field(), "default_plan");
}

#[test]
fn a_plan_keeps_its_state_apart_unless_it_shares() {
    let own = Plan::new("free", [limit(10)]).unwrap();
    let shared = own.clone().with_shared_state(true);
    let stored = own.stored_limits().unwrap();
    assert_eq!(stored[0].id(), format!("@free:{}", limit(10).id()));
    assert_ne!(stored[0].fingerprint(), limit(10).fingerprint());
    assert_ne!(
        stored[0].params_fingerprint(),
        limit(10).params_fingerprint()
    );
    assert_eq!(shared.stored_limits().unwrap()[0], limit(10));
    let paid = Plan::new("paid", [limit(10)])
        .unwrap()
        .stored_limits()
        .unwrap();
    assert_ne!(paid[0].fingerprint(), stored[0].fingerprint());
}
