//! The example gateway reloading its config while real HTTP clients keep it busy: by
//! SIGHUP, by an edit of the file, and refusing a bad file. In-process, as in
//! `tests/gateway.rs`: the gateway's modules come from `common/modules.rs`.

include!("common/modules.rs");
#[cfg(feature = "redis")]
use tollgate_test_support as support;

use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{body::Body, http::StatusCode};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

use config::Config;
use server::Running;

type HttpClient = Client<HttpConnector, Body>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// How long a reload may take to show, however loaded the machine is.
const PATIENCE: Duration = Duration::from_secs(20);

/// A config: `/load` with a limit no test reaches, `/api` with `api_limit` per hour per
/// `x-key`.
fn config_text(store: &str, listen: &str, api_limit: &str, on_change: &str) -> String {
    format!(
        r#"listen = "{listen}"
{store}
[[routes]]
path = "/load"
[[routes.limits]]
key = "global"
algorithm = "fixed_window"
limit = 1000000
window = "1h"

[[routes]]
path = "/api"
[[routes.limits]]
name = "api"
key = "header:x-key"
algorithm = "fixed_window"
limit = {api_limit}
window = "1h"
on_change = "{on_change}"
"#
    )
}

/// A file in a directory of its own, removed at the end.
struct ConfigFile {
    dir: PathBuf,
    path: PathBuf,
}

impl ConfigFile {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tollgate-reload-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gateway.toml");
        Self { dir, path }
    }

    /// Writes `text` the way editors do: a new file renamed over the old one.
    fn write(&self, text: &str) {
        let next = self.dir.join("gateway.toml.new");
        std::fs::write(&next, text).unwrap();
        std::fs::rename(&next, &self.path).unwrap();
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn status(client: &HttpClient, gateway: &Running, path: &str, key: &str) -> StatusCode {
    let request = http::Request::get(format!("http://{}{path}", gateway.addr()))
        .header("x-key", key)
        .body(Body::empty())
        .unwrap();
    let response = tokio::time::timeout(PATIENCE, client.request(request))
        .await
        .expect("an answer in time")
        .expect("no failed request");
    response.status()
}

/// `n` requests to `/api` as `key`: how many were allowed.
async fn allowed(client: &HttpClient, gateway: &Running, key: &str, n: u32) -> u32 {
    let mut allowed = 0;
    for _ in 0..n {
        match status(client, gateway, "/api", key).await {
            StatusCode::OK => allowed += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    allowed
}

/// Waits until the gateway runs `version` or a later one (a file edit and a SIGHUP may
/// both apply one file).
async fn wait_for_version(gateway: &Running, version: u64) {
    let start = Instant::now();
    while gateway.version() < version {
        assert!(
            start.elapsed() < PATIENCE,
            "still version {}",
            gateway.version()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SIGHUP goes to the whole process, so to every gateway of this binary: the tests take
/// turns.
static SIGNALS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Four clients that keep `/load` busy until stopped; every answer must be 200.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<u64>>,
}

impl Load {
    fn start(gateway: &Running) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..4)
            .map(|i| {
                let stop = stop.clone();
                let url = format!("http://{}/load", gateway.addr());
                tokio::spawn(async move {
                    let client = client();
                    let mut answered = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let request = http::Request::get(&url)
                            .header("x-key", format!("load-{i}"))
                            .body(Body::empty())
                            .unwrap();
                        let response = client.request(request).await.expect("no failed request");
                        assert_eq!(response.status(), StatusCode::OK, "under load");
                        answered += 1;
                    }
                    answered
                })
            })
            .collect::<Vec<_>>();
        let mut tasks = tasks;
        // And one client on a single connection, kept open across every reload: a reload
        // that closed connections would fail its next request.
        let stop_one = stop.clone();
        let addr = gateway.addr();
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                    .await
                    .unwrap();
            tokio::spawn(connection);
            let mut answered = 0;
            while !stop_one.load(Ordering::Relaxed) {
                sender.ready().await.expect("the connection stays open");
                let request = http::Request::get("/load")
                    .header("host", addr.to_string())
                    .body(Body::empty())
                    .unwrap();
                let response = sender
                    .send_request(request)
                    .await
                    .expect("no failed request");
                assert_eq!(response.status(), StatusCode::OK, "on the kept connection");
                http_body_util::BodyExt::collect(response.into_body())
                    .await
                    .unwrap();
                answered += 1;
            }
            answered
        }));
        Self { stop, tasks }
    }

    async fn finish(self) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            let answered = task.await.unwrap();
            assert!(answered > 0, "a load client never got an answer");
        }
    }
}

/// Reloads by a file edit and by SIGHUP while four clients keep the gateway busy: no
/// request fails, the new limit applies to the next request, a bad file is refused with
/// the old limits still enforced, and a change of `listen` (restart only) keeps the
/// running address.
async fn reloads_under_load(store: &str, name: &str) {
    let _turn = SIGNALS.lock().await;
    let file = ConfigFile::new(name);
    file.write(&config_text(store, "127.0.0.1:0", "2", "reset"));
    let config = Config::load(&file.path).unwrap();
    let mut gateway = server::start(config).await.unwrap();
    gateway.watch(file.path.clone(), Duration::from_millis(50));
    let client = client();
    let load = Load::start(&gateway);

    assert_eq!(allowed(&client, &gateway, "a", 3).await, 2);

    // An edit: 5 per hour, carried over from now on. A reset limit that changed starts
    // fresh: "a" gets all 5.
    file.write(&config_text(store, "127.0.0.1:0", "5", "carry_over"));
    wait_for_version(&gateway, 2).await;
    assert_eq!(allowed(&client, &gateway, "a", 6).await, 5);

    // A bad file: refused, version and limits stay.
    file.write(&config_text(store, "127.0.0.1:0", "0", "carry_over"));
    let mut watcher = reload::Watcher::new(file.path.clone(), gateway_live(&gateway));
    let refused = watcher.reload().unwrap_err();
    assert_eq!(refused.field, "routes[1].limits[0].limit");
    tokio::time::sleep(Duration::from_millis(300)).await; // several polls of the bad file
    assert_eq!(gateway.version(), 2);
    assert_eq!(allowed(&client, &gateway, "b", 6).await, 5);

    // SIGHUP after a good edit (the poll may see it first: either applies it once). 7 per
    // hour, carried over: "a" spent 5, so 2 are left; and `listen` changed, which needs a
    // restart: the gateway keeps serving where it is.
    file.write(&config_text(store, "127.0.0.1:1", "7", "carry_over"));
    sighup();
    wait_for_version(&gateway, 3).await;
    assert_eq!(allowed(&client, &gateway, "a", 5).await, 2);
    assert_eq!(allowed(&client, &gateway, "c", 9).await, 7);

    load.finish().await;
    gateway.stop().await.unwrap();
}

/// A SIGHUP alone (the file unchanged since the last poll) reloads too.
async fn sighup_reloads(store: &str, name: &str) {
    let _turn = SIGNALS.lock().await;
    let file = ConfigFile::new(name);
    file.write(&config_text(store, "127.0.0.1:0", "1", "carry_over"));
    let config = Config::load(&file.path).unwrap();
    let mut gateway = server::start(config).await.unwrap();
    // Polled once an hour: only the signal can reload it during this test.
    gateway.watch(file.path.clone(), Duration::from_secs(3600));
    let client = client();
    let load = Load::start(&gateway);
    assert_eq!(allowed(&client, &gateway, "a", 2).await, 1);
    file.write(&config_text(store, "127.0.0.1:0", "3", "carry_over"));
    // Other tests' gateways may reload on this signal too: harmless, they reread their
    // own files.
    sighup();
    wait_for_version(&gateway, 2).await;
    assert_eq!(allowed(&client, &gateway, "a", 3).await, 2);
    load.finish().await;
    gateway.stop().await.unwrap();
}

fn gateway_live(gateway: &Running) -> Arc<server::Live> {
    gateway.live()
}

fn sighup() {
    let status = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_reloads_under_load() {
    reloads_under_load("", "memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_sighup_reloads() {
    sighup_reloads("", "memory-hup").await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_reloads_under_load() {
    let server = support::RedisServer::start();
    let store = format!("[store]\nbackend = \"redis\"\nurl = \"{}\"\n", server.url());
    reloads_under_load(&store, "redis").await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sighup_reloads() {
    let server = support::RedisServer::start();
    let store = format!("[store]\nbackend = \"redis\"\nurl = \"{}\"\n", server.url());
    sighup_reloads(&store, "redis-hup").await;
}

#[test]
fn carried_over_limits_sharing_a_budget_are_refused() {
    let mut text = config_text("", "127.0.0.1:0", "2", "carry_over");
    text += r#"[[routes.limits]]
name = "api"
key = "header:x-key"
algorithm = "fixed_window"
limit = 3
window = "1h"
on_change = "carry_over"
"#;
    let err = Config::parse(&text).unwrap_err();
    assert_eq!(err.field, "routes[1].limits[1].name");
    let bad = config_text("", "127.0.0.1:0", "2", "keep");
    assert_eq!(
        Config::parse(&bad).unwrap_err().field,
        "routes[1].limits[0].on_change"
    );
}

/// Two gateways following one rule set in Redis.
#[cfg(feature = "redis")]
mod fleet {
    use super::*;

    fn rule_set(limit: &str) -> String {
        format!(
            r#"[[routes]]
path = "/api"
[[routes.limits]]
name = "api"
key = "header:x-key"
algorithm = "fixed_window"
limit = {limit}
window = "1h"
on_change = "carry_over"
"#
        )
    }

    async fn replica(url: &str) -> Running {
        replica_checking(url, "1s").await
    }

    /// A replica that reads the rule set's version every `check_interval`.
    async fn replica_checking(url: &str, check_interval: &str) -> Running {
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"{url}\"\n\
             [rules]\nsource = \"redis\"\ncheck_interval = \"{check_interval}\"\n{}",
            rule_set("2")
        );
        server::start(Config::parse(&text).unwrap()).await.unwrap()
    }

    /// `store.connect = "background"` with `[rules] source = "redis"`: a replica starts
    /// while Redis is down, serving the file's routes (`on_error = "allow"`: unlimited),
    /// and once Redis is up it follows the rule set published there and limits by it.
    #[tokio::test]
    async fn a_replica_started_before_redis_follows_the_rule_set_once_it_is_up() {
        let port = support::free_port();
        let url = support::loopback_url(port, false);
        let text = format!(
            "listen = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"{url}\"\n\
             connect = \"background\"\n\
             [rules]\nsource = \"redis\"\ncheck_interval = \"100ms\"\n{}",
            rule_set("2")
        );
        let a = server::start(Config::parse(&text).unwrap()).await.unwrap();
        assert_eq!(super::allowed(&client(), &a, "x", 4).await, 4);
        let _server = support::RedisServer::start_on(port, &[]);
        let location = rules_source::Location::new(&url, "tollgate");
        assert_eq!(
            rules_source::publish(&location, &rule_set("5"))
                .await
                .unwrap(),
            1
        );
        let applied = Instant::now();
        while a.version() < 2 {
            assert!(applied.elapsed() < PATIENCE, "the rule set was not applied");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The store connects on its own schedule (within about 2 s of Redis coming up):
        // until then requests pass unlimited, so wait for the first one Redis counts.
        let client = client();
        let connected = Instant::now();
        while !status_with_fields(&client, &a, "y").await {
            assert!(connected.elapsed() < PATIENCE, "the store did not connect");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(super::allowed(&client, &a, "z", 6).await, 5);
        a.stop().await.unwrap();
    }

    /// Whether a request under key `key` was decided by the store (it has rate-limit
    /// fields).
    async fn status_with_fields(client: &HttpClient, gateway: &Running, key: &str) -> bool {
        let request = http::Request::get(format!("http://{}/api", gateway.addr()))
            .header("x-key", key)
            .body(Body::empty())
            .unwrap();
        let response = client.request(request).await.unwrap();
        response.headers().contains_key("ratelimit")
    }

    /// What the guide's "ACL users" (src/guide/redis.md) adds to its least-privilege ACL line for a gateway that
    /// follows a rule set, and for the user that publishes one.
    const FOLLOWER_ACL: &[&str] = &["+mget", "+subscribe", "&tollgate:rules"];
    const PUBLISHER_ACL: &[&str] = &[
        "+set",
        "+incrby",
        "+multi",
        "+exec",
        "+publish",
        "&tollgate:rules",
    ];

    /// As documented, an ACL user follows rule sets by their announcements (the periodic
    /// check is an hour away) and another publishes them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn acl_users_follow_and_publish_rule_sets_as_documented() {
        let server = support::RedisServer::start();
        let user = |name: &str, extra: &[&str]| {
            let mut rules = support::acl::documented_rules(name, "tollgate");
            // Redis 6.0 has no channel rules: every user may use every channel.
            let channels = support::redis_server_version() >= (6, 2);
            rules.extend(
                extra
                    .iter()
                    .filter(|rule| channels || !rule.starts_with('&'))
                    .map(|rule| (*rule).to_owned()),
            );
            support::acl::set_user(&server, &rules);
            support::acl::url_for(&server, name)
        };
        let follower = user("follower", FOLLOWER_ACL);
        let publisher = user("publisher", PUBLISHER_ACL);
        let a = replica_checking(&follower, "1h").await;
        let subscribed = Instant::now();
        let subscribers = || server.cli(&["PUBSUB", "NUMSUB", "tollgate:rules"]).unwrap();
        while subscribers().trim() != "tollgate:rules\n1" {
            assert!(
                subscribed.elapsed() < PATIENCE,
                "the replica did not subscribe"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let location = rules_source::Location::new(&publisher, "tollgate");
        let version = rules_source::publish(&location, &rule_set("5")).await;
        assert_eq!(version.unwrap(), 1);
        let applied = Instant::now();
        while a.version() < 2 {
            assert!(
                applied.elapsed() < PATIENCE,
                "the announcement was not applied"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(super::allowed(&client(), &a, "x", 6).await, 5);
        a.stop().await.unwrap();
    }

    /// A follower that may not subscribe (the ACL line without the channel) says so once,
    /// instead of silently waiting for the periodic check.
    #[tokio::test]
    async fn a_follower_that_cannot_subscribe_says_so() {
        let (logs, _guard) = support::logs::Logs::capture();
        let server = support::RedisServer::start();
        let mut rules = support::acl::documented_rules("follower", "tollgate");
        rules.push("+mget".to_owned());
        support::acl::set_user(&server, &rules);
        let url = support::acl::url_for(&server, "follower");
        let a = replica_checking(&url, "50ms").await;
        let start = Instant::now();
        while !logs.text().contains("cannot subscribe to announcements") {
            assert!(start.elapsed() < PATIENCE, "no warning: {}", logs.text());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Retried at every check, logged once.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let text = logs.text();
        assert_eq!(text.matches("cannot subscribe").count(), 1, "{text}");
        assert!(text.contains("NOPERM") || text.contains("NoPerm"), "{text}");
        a.stop().await.unwrap();
    }

    /// Waits until both replicas run `version` or later: how long it took.
    async fn both_at(replicas: &[&Running; 2], version: u64) -> Duration {
        let start = Instant::now();
        while replicas.iter().any(|r| r.version() < version) {
            assert!(start.elapsed() < PATIENCE, "replicas did not follow");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        start.elapsed()
    }

    /// `n` requests as `key`, alternating between the replicas: how many were allowed.
    async fn allowed_across(
        client: &HttpClient,
        replicas: &[&Running; 2],
        key: &str,
        n: u32,
    ) -> u32 {
        let mut allowed = 0;
        for i in 0..n {
            allowed += super::allowed(client, replicas[i as usize % 2], key, 1).await;
        }
        allowed
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replicas_follow_the_rule_set_and_keep_the_last_good_one() {
        let server = support::RedisServer::start();
        let url = server.url();
        let a = replica(&url).await;
        let b = replica(&url).await;
        let replicas = [&a, &b];
        let client = client();
        // No rule set yet: the file's 2 per hour.
        assert_eq!(allowed_across(&client, &replicas, "x", 4).await, 2);

        // Published and announced: both apply it, within about a second.
        let location = rules_source::Location::new(&url, "tollgate");
        assert_eq!(
            rules_source::publish(&location, &rule_set("5"))
                .await
                .unwrap(),
            1
        );
        let took = both_at(&replicas, 2).await;
        eprintln!("announced rule set applied by both replicas in {took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        // One budget in Redis, carried over: "x" spent 2 of the 5.
        assert_eq!(allowed_across(&client, &replicas, "x", 6).await, 3);
        assert_eq!(allowed_across(&client, &replicas, "y", 7).await, 5);

        // A bad set (written past the publisher's validation): refused by both, whose
        // limits stay.
        let bad = rule_set("0");
        assert!(rules_source::publish(&location, &bad).await.is_err());
        server.cli(&["SET", "tollgate:rules", &bad]).unwrap();
        server.cli(&["INCR", "tollgate:rules:version"]).unwrap();
        server.cli(&["PUBLISH", "tollgate:rules", "2"]).unwrap();
        tokio::time::sleep(Duration::from_millis(2_500)).await; // two periodic checks
        assert_eq!((a.version(), b.version()), (2, 2));
        assert_eq!(allowed_across(&client, &replicas, "z", 7).await, 5);

        // A change whose announcement is lost: the periodic check finds it.
        server
            .cli(&["SET", "tollgate:rules", &rule_set("8")])
            .unwrap();
        server.cli(&["INCR", "tollgate:rules:version"]).unwrap();
        let took = both_at(&replicas, 3).await;
        eprintln!("unannounced rule set applied by both replicas in {took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert_eq!(allowed_across(&client, &replicas, "z", 4).await, 3);

        // A new replica starts with the fleet's rules, not its file's.
        let c = replica(&url).await;
        assert_eq!(super::allowed(&client, &c, "z", 2).await, 0);
        assert_eq!(super::allowed(&client, &c, "w", 9).await, 8);
        for replica in [a, b, c] {
            replica.stop().await.unwrap();
        }
    }
}

/// A reload that changes limits and route options which are rules (`delay`, a limit)
/// keeps the running layers (their `RulesHandle`s get the new rules) while clients keep
/// the gateway busy: requests waiting under `delay` before the reload are answered in
/// their order, and a response streaming before it still holds its `max_in_flight`
/// permit after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_waiting_and_in_flight_requests() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let upstream = {
        let gate = gate.clone();
        axum::Router::new().fallback(move || {
            let gate = gate.clone();
            async move {
                Body::from_stream(futures_util::stream::once(async move {
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, std::convert::Infallible>(axum::body::Bytes::from_static(b"done"))
                }))
            }
        })
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, upstream).await.unwrap() });
    let text = |held_limit: u32, delay: &str| {
        format!(
            r#"listen = "127.0.0.1:0"
[[routes]]
path = "/load"
[[routes.limits]]
key = "global"
algorithm = "fixed_window"
limit = 1000000
window = "1h"

[[routes]]
path = "/held"
upstream = "http://{upstream_addr}"
max_in_flight = 1
[[routes.limits]]
key = "header:x-key"
algorithm = "fixed_window"
limit = {held_limit}
window = "1h"

[[routes]]
path = "/slow"
delay = "{delay}"
[[routes.limits]]
key = "global"
algorithm = "gcra"
limit = 1
window = "1s"
"#
        )
    };
    let gateway = server::start(Config::parse(&text(1000, "5s")).unwrap())
        .await
        .unwrap();
    let load = Load::start(&gateway);
    let client = client();
    let held_request = || {
        let request = http::Request::get(format!("http://{}/held", gateway.addr()))
            .header("x-key", "a")
            .body(Body::empty())
            .unwrap();
        let response = client.request(request);
        async move {
            tokio::time::timeout(PATIENCE, response)
                .await
                .expect("an answer in time")
                .expect("no failed request")
        }
    };
    let held = held_request().await;
    assert_eq!(held.status(), StatusCode::OK);
    assert_eq!(held_request().await.status(), StatusCode::TOO_MANY_REQUESTS);

    // One request spends /slow's budget; two more wait in its line, in this order.
    assert_eq!(
        status(&client, &gateway, "/slow", "w").await,
        StatusCode::OK
    );
    let waiter = || {
        let (client, gateway_addr) = (client.clone(), gateway.addr());
        tokio::spawn(async move {
            let request = http::Request::get(format!("http://{gateway_addr}/slow"))
                .body(Body::empty())
                .unwrap();
            let response = tokio::time::timeout(PATIENCE, client.request(request))
                .await
                .expect("an answer in time")
                .expect("no failed request");
            (response.status(), Instant::now())
        })
    };
    let first = waiter();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = waiter();
    tokio::time::sleep(Duration::from_millis(100)).await;

    // The reload: another limit on /held, another delay on /slow.
    let version = gateway
        .live()
        .apply(Config::parse(&text(2000, "6s")).unwrap())
        .unwrap();
    assert_eq!(version, 2);
    assert_eq!(
        held_request().await.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the reload forgot the request in flight"
    );
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!((first.0, second.0), (StatusCode::OK, StatusCode::OK));
    assert!(first.1 <= second.1, "the line kept its order");

    gate.add_permits(1);
    let body = http_body_util::BodyExt::collect(held.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(&body[..], b"done");
    let start = Instant::now();
    while held_request().await.status() != StatusCode::OK {
        assert!(start.elapsed() < PATIENCE, "the permit never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gate.add_permits(16);
    load.finish().await;
    gateway.stop().await.unwrap();
}

/// A reload that changes a limit keeps the route's circuit breaker: open stays open (the
/// store is not asked, though it answers again); a reload that changes the breaker's own
/// settings starts it closed. Before, every reload rebuilt the layers and closed every
/// breaker.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_breaker_stays_open_across_a_reload_that_changes_a_limit() {
    let server = support::RedisServer::start();
    let text = |limit: u32, cooldown: &str| {
        format!(
            r#"listen = "127.0.0.1:0"
[store]
backend = "redis"
url = "{}"
timeout_ms = 300
on_error = "deny"
breaker_failures = 3
breaker_cooldown = "{cooldown}"
[[routes]]
path = "/api"
[[routes.limits]]
key = "header:x-key"
algorithm = "fixed_window"
limit = {limit}
window = "1h"
"#,
            server.url()
        )
    };
    let gateway = server::start(Config::parse(&text(100, "1h")).unwrap())
        .await
        .unwrap();
    let client = client();
    assert_eq!(status(&client, &gateway, "/api", "a").await, StatusCode::OK);
    // Redis stops answering for 5 s: three timeouts open the breaker.
    server.cli(&["CLIENT", "PAUSE", "5000"]).unwrap();
    for _ in 0..3 {
        assert_eq!(
            status(&client, &gateway, "/api", "a").await,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    // Answered once the pause is over.
    server.cli(&["PING"]).unwrap();
    // Open: denied without asking Redis, which answers again.
    assert_eq!(
        status(&client, &gateway, "/api", "a").await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        gateway
            .live()
            .apply(Config::parse(&text(200, "1h")).unwrap()),
        Ok(2)
    );
    assert_eq!(
        status(&client, &gateway, "/api", "a").await,
        StatusCode::SERVICE_UNAVAILABLE,
        "the reload closed the open breaker"
    );
    // New breaker settings: a breaker that starts closed, and Redis answers.
    assert_eq!(
        gateway
            .live()
            .apply(Config::parse(&text(200, "2h")).unwrap()),
        Ok(3)
    );
    assert_eq!(status(&client, &gateway, "/api", "a").await, StatusCode::OK);
    gateway.stop().await.unwrap();
}
