//! README's embedding example works as shown: it is the example
//! `embedding` word for word, and run against the local services with the
//! settings README names, it consumes its queue and counts a check-in once.

use std::time::Duration;

use rabbit_inbox::tools::lapin::BasicProperties;
use uuid::Uuid;

use crate::support::{REPOSITORY, TestEnv, amqp, amqp_url, database_url_of, publish_to, wait_until};

/// The queue README's example declares in code.
const QUEUE: &str = "embedded.attendee-checked-in";

fn readme_block() -> String {
    let readme = std::fs::read_to_string(format!("{REPOSITORY}/README.md")).unwrap();
    let section = &readme[readme
        .find("## Embedding")
        .expect("README has its Embedding section")..];
    let start = section.find("```rust,no_run\n").expect("a Rust block") + "```rust,no_run\n".len();
    let end = start + section[start..].find("```").unwrap();
    section[start..end].to_owned()
}

#[test]
fn readmes_embedding_example_is_the_example_word_for_word() {
    let example = std::fs::read_to_string(format!("{REPOSITORY}/inbox/examples/embedding.rs")).unwrap();
    let code: String = example
        .lines()
        .skip_while(|line| line.starts_with("//!") || line.is_empty())
        .map(|line| format!("{line}\n"))
        .collect();
    assert_eq!(
        code,
        readme_block(),
        "inbox/examples/embedding.rs and README's Embedding block differ"
    );
}

#[actix_rt::test]
async fn readmes_embedding_example_run_as_shown_counts_a_check_in_once() {
    let env = TestEnv::new("readme_embedding").await;
    let binary = crate::support::checkin_service().with_file_name("embedding");
    let mut service = std::process::Command::new(binary)
        .current_dir(REPOSITORY)
        .env("INBOX__DATABASE__URL", database_url_of(&env.database))
        .env("INBOX__MESSAGE_BUS__AMQP_URLS", amqp_url())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the embedding example starts");
    wait_until("it consumes its queue", || async {
        env.consumers(QUEUE).await == Some(1)
    })
    .await;
    // One check-in, delivered twice (a redelivery): counted once.
    let id = Uuid::now_v7();
    for _ in 0..2 {
        let properties = BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_type("AttendeeCheckedIn".into())
            .with_content_type("application/json".into());
        publish_to("", QUEUE, properties, br#"{"attendee_id": 7, "session_id": 1}"#).await;
    }
    wait_until("the check-in is counted", || async {
        env.scalar("SELECT count(*) FROM attendee_checkins WHERE attendee_id = 7 AND checkins = 1")
            .await
            == 1
    })
    .await;
    wait_until("the queue is empty", || async { env.ready(QUEUE).await == 0 }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        env.scalar("SELECT sum(checkins)::bigint FROM attendee_checkins")
            .await,
        1,
        "the redelivery is skipped"
    );
    // SIGTERM: it drains and exits 0.
    let pid = service.id().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let status = service.wait().unwrap();
    assert!(status.success(), "exit status {status:?}");

    // Its queues, and those kept beside it, go with the test.
    // (A channel each: deleting one that is not there closes it.)
    let connection = amqp().await;
    let kept = (1..=3).map(|tier| format!("{QUEUE}.retry.{tier}"));
    for name in kept.chain([
        QUEUE.to_owned(),
        format!("{QUEUE}.error"),
        format!("{QUEUE}.skipped"),
    ]) {
        let channel = connection.create_channel().await.unwrap();
        let _ = channel
            .queue_delete(name.as_str().into(), Default::default())
            .await;
    }
    let _ = connection.close(200, "done".into()).await;
}

/// What a user doc must not hold: the history of its making belongs in
/// commits, issues and CONTRIBUTING.md.
fn diary_words(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let words: Vec<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| !w.is_empty())
        .collect();
    for (i, word) in words.iter().enumerate() {
        let lower = word.to_ascii_lowercase();
        let is_date = word.len() == 10
            && word.starts_with("20")
            && word.as_bytes()[4] == b'-'
            && word.as_bytes()[7] == b'-'
            && word.bytes().filter(u8::is_ascii_digit).count() == 8;
        let is_commit = (7..=12).contains(&word.len())
            && word
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            && word.bytes().any(|b| b.is_ascii_digit())
            && word.bytes().any(|b| b.is_ascii_alphabetic());
        let is_issue_talk = lower == "issue" || lower == "issues" || lower == "vm" || lower == "2-core";
        let is_milestone = matches!(lower.as_str(), "performance" | "hardening" | "shape")
            && words
                .get(i + 1)
                .is_some_and(|next| matches!(*next, "I" | "II" | "III" | "IV" | "V"));
        if is_date || is_commit || is_issue_talk || is_milestone {
            found.push((*word).to_owned());
        }
    }
    found
}

#[test]
fn user_docs_hold_no_dated_runs_machines_commits_or_issue_talk() {
    let mut docs = vec![format!("{REPOSITORY}/README.md")];
    for entry in std::fs::read_dir(format!("{REPOSITORY}/docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path.display().to_string());
        }
    }
    let mut offences = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        for word in diary_words(&text) {
            offences.push(format!("{doc}: {word}"));
        }
    }
    assert!(offences.is_empty(), "user docs hold a diary: {offences:#?}");
    let performance = std::fs::read_to_string(format!("{REPOSITORY}/docs/performance.md")).unwrap();
    assert!(
        performance.lines().count() <= 120,
        "docs/performance.md is a page, not a notebook"
    );
    assert_eq!(
        diary_words("Measured on 2026-12-06 (ecfa281) on a 2-core VM for the issue, Performance III"),
        ["2026-12-06", "ecfa281", "2-core", "VM", "issue", "Performance"]
    );
}

#[test]
fn the_example_service_names_an_option_it_does_not_know_and_shows_its_usage() {
    let output = std::process::Command::new(crate::support::checkin_service())
        .args(["--http", "127.0.0.1:0", "--ops-tokns", "tokens"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "refused, not run without it");
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(
        said.contains("'--ops-tokns'") && said.contains("usage:"),
        "{said}"
    );
    let help = std::process::Command::new(crate::support::checkin_service())
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--ops-tokens FILE"));
}
