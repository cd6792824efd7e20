//! The operator page in a real browser: Debian's headless Chromium, driven
//! through chromedriver (WebDriver), against the example service run as
//! README shows it, with `--http` and `--ops-tokens`.
//!
//! Needs `chromium` and `chromium-driver` (`apt-get install chromium
//! chromium-driver`; CI installs them). Without them it says so and does
//! not run, unless `INBOX_REQUIRE_BROWSER=1` (CI), which makes their
//! absence a failure. `INBOX_OPS_SCREENSHOT=FILE` saves a screenshot of
//! the page (README's).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use rabbit_inbox::tools::lapin::BasicProperties;
use uuid::Uuid;

use crate::support::{Killed, TestEnv, free_port, publish_to, start_ops_service, wait_until};

const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM: &str = "/usr/bin/chromium";
const OPERATOR: &str = "alice-operator-token-0123";
const READER: &str = "bob-reader-token-0123456";

async fn browser() -> Option<(Client, Killed)> {
    if !std::path::Path::new(CHROMEDRIVER).exists() || !std::path::Path::new(CHROMIUM).exists() {
        let required = std::env::var("INBOX_REQUIRE_BROWSER").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "INBOX_REQUIRE_BROWSER=1 but {CHROMEDRIVER} or {CHROMIUM} is missing: apt-get install chromium chromium-driver"
        );
        eprintln!(
            "browser test NOT RUN: {CHROMEDRIVER} or {CHROMIUM} is missing (apt-get install chromium chromium-driver)"
        );
        return None;
    }
    let port = free_port();
    let driver = Killed(
        Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts"),
    );
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": CHROMIUM,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000"],
        }),
    );
    let started = Instant::now();
    loop {
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match ClientBuilder::new(connector)
            .capabilities(capabilities.clone())
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
        {
            Ok(client) => return Some((client, driver)),
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("chromedriver did not start a session: {e}"),
        }
    }
}

/// Clicks the element `css` finds.
async fn click(client: &Client, css: &str) {
    client
        .find(Locator::Css(css))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// The text of the element `css` finds, once it is there.
async fn text_of(client: &Client, css: &str) -> String {
    client
        .wait()
        .for_element(Locator::Css(css))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The texts of the elements `css` finds.
async fn texts(client: &Client, css: &str) -> Vec<String> {
    let mut texts = Vec::new();
    for element in client.find_all(Locator::Css(css)).await.unwrap() {
        texts.push(element.text().await.unwrap());
    }
    texts
}

async fn sign_in(client: &Client, base: &str, token: &str) {
    client.goto(&format!("{base}/ops/")).await.unwrap();
    client
        .find(Locator::Css("#login input[name=token]"))
        .await
        .unwrap()
        .send_keys(token)
        .await
        .unwrap();
    click(client, "#login button").await;
    client.wait().for_element(Locator::Css("#who")).await.unwrap();
}

/// Waits until `#job-progress` (refreshed every second) says 100%.
async fn job_reaches_100(client: &Client) -> String {
    let started = Instant::now();
    loop {
        // The page reloads under us: an element may go stale between finding
        // and reading it.
        if let Ok(element) = client.find(Locator::Css("#job-progress")).await
            && let Ok(text) = element.text().await
            && text == "100%"
        {
            return client
                .find(Locator::Css("#job-status"))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the job did not reach 100%"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[actix_rt::test]
async fn an_operator_filters_opens_redrives_and_discards_and_a_reader_sees_no_action() {
    let Some((client, _driver)) = browser().await else {
        return;
    };
    let env = TestEnv::new("ops_browser").await;
    let tokens = std::env::temp_dir().join(format!("inbox-browser-tokens-{}", Uuid::new_v4()));
    std::fs::write(
        &tokens,
        format!("alice operator {OPERATOR}\nbob reader {READER}\n"),
    )
    .unwrap();
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let base = format!("http://{address}");
    let service = start_ops_service(&env.database, &env.queue, &address, &tokens);

    // Three check-ins the service refuses (negative attendees), and a
    // message of a type it does not know.
    let publish = |kind: &str, body: String| {
        let properties = BasicProperties::default()
            .with_message_id(Uuid::now_v7().to_string().into())
            .with_type(kind.into())
            .with_content_type("application/json".into());
        let queue = env.queue.clone();
        async move { publish_to("", &queue, properties, body.as_bytes()).await }
    };
    wait_until("the service consumes its queue", || async {
        env.consumers(&env.queue).await == Some(1)
    })
    .await;
    for attendee in [-1, -2, -3] {
        publish(
            "AttendeeCheckedIn",
            format!(r#"{{"attendee_id": {attendee}, "session_id": 7}}"#),
        )
        .await;
    }
    publish("SeatReserved", r#"{"seat": "12B"}"#.into()).await;
    wait_until("four failures in the table", || async {
        env.scalar("SELECT count(*) FROM inbox_failures").await == 4
    })
    .await;

    sign_in(&client, &base, OPERATOR).await;

    // Filter by type.
    let filter = client.form(Locator::Css("#filter")).await.unwrap();
    filter.set_by_name("type", "AttendeeCheckedIn").await.unwrap();
    click(&client, "#filter button").await;
    // The filtered page is loaded once the address says so.
    wait_until("the filtered page loads", || async {
        client
            .current_url()
            .await
            .is_ok_and(|url| url.as_str().contains("type=AttendeeCheckedIn"))
    })
    .await;
    let types = texts(&client, "#failures tr.failure td.type").await;
    assert_eq!(types, vec!["AttendeeCheckedIn"; 3], "only the filtered type");

    // Open one message: its headers and body.
    click(&client, "#failures tr.failure a").await;
    let headers = text_of(&client, "#headers").await;
    assert!(headers.contains("x-inbox-reason"), "{headers}");
    let body = client
        .find(Locator::Css("#body"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(body.contains("attendee_id"), "{body}");

    // Redrive the check-ins' group at 2 a second, confirmed, and watch it.
    client.goto(&format!("{base}/ops/")).await.unwrap();
    let mut redrove = false;
    for row in client.find_all(Locator::Css("#groups tr.group")).await.unwrap() {
        if !row.text().await.unwrap().contains("AttendeeCheckedIn") {
            continue;
        }
        let form = row.find(Locator::Css("form.redrive-group")).await.unwrap();
        form.find(Locator::Css("input[name=rate_per_second]"))
            .await
            .unwrap()
            .send_keys("2")
            .await
            .unwrap();
        form.find(Locator::Css("button"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        redrove = true;
        break;
    }
    assert!(redrove, "the check-ins' group offers a redrive");
    let count = text_of(&client, "#confirm-count").await;
    assert_eq!(count, "3", "the confirmation says how many");
    click(&client, "#confirm").await;
    assert_eq!(job_reaches_100(&client).await, "done");

    // Discard the unknown type with a reason, and find it in the audit.
    client
        .goto(&format!("{base}/ops/?type=SeatReserved"))
        .await
        .unwrap();
    click(&client, "#failures tr.failure a").await;
    let discard = client
        .wait()
        .for_element(Locator::Css("form#discard"))
        .await
        .unwrap();
    discard
        .find(Locator::Css("input[name=reason]"))
        .await
        .unwrap()
        .send_keys("not ours: billing's event")
        .await
        .unwrap();
    discard
        .find(Locator::Css("button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    client
        .wait()
        .for_element(Locator::Css("#confirm"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert_eq!(job_reaches_100(&client).await, "done");
    client.goto(&format!("{base}/ops/")).await.unwrap();
    if let Ok(path) = std::env::var("INBOX_OPS_SCREENSHOT") {
        std::fs::write(path, client.screenshot().await.unwrap()).unwrap();
    }
    let mut found = false;
    for row in client
        .find_all(Locator::Css("#audit tr.audit-entry"))
        .await
        .unwrap()
    {
        let action = row
            .find(Locator::Css("td.action"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let reason = row
            .find(Locator::Css("td.reason"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        found |= action == "discard" && reason == "not ours: billing's event";
    }
    assert!(found, "the discard and its reason are in the audit");
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM inbox_failures WHERE status = 'discarded' AND message_type = 'SeatReserved'"
        )
        .await,
        1
    );

    // A reader: the same page, no action at all.
    click(&client, "header form button").await;
    client.wait().for_element(Locator::Css("#login")).await.unwrap();
    sign_in(&client, &base, READER).await;
    let actions =
        "form.redrive-group, form.discard-group, #redrive-filter, button.pause-queue, button.resume-queue";
    assert!(
        client.find_all(Locator::Css(actions)).await.unwrap().is_empty(),
        "a reader sees no action"
    );
    click(&client, "#failures tr.failure a").await;
    client.wait().for_element(Locator::Css("#headers")).await.unwrap();
    assert!(
        client
            .find_all(Locator::Css("#actions, form#redrive, form#discard"))
            .await
            .unwrap()
            .is_empty(),
        "nor on a message"
    );
    client.close().await.unwrap();
    drop(service);
    let _ = std::fs::remove_file(&tokens);
}
