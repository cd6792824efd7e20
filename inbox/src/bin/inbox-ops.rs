//! `inbox-ops`: the operator plane from a command line, inside the
//! service's container, with the service's own settings (`config/`,
//! `INBOX_ENV`, `INBOX__…`). Installed with `cargo install inbox` (or
//! `cargo install --path inbox` from this repository).
//!
//! It answers in the JSON the operations API answers (docs/operations.md).
//! Whoever runs it holds the service's database credentials, so it acts as
//! an admin; `--as NAME` (default: `cli:$USER`) is the name written in the
//! audit.

use std::collections::HashMap;
use std::process::ExitCode;

use rabbit_inbox::ops::{Filter, Operations, Operator, Role, Selection};
use rabbit_inbox::uuid::Uuid;

const USAGE: &str = "\
usage: inbox-ops [--as NAME] COMMAND [OPTIONS]

  failures [FILTER] [--limit N] [--after CURSOR]   list failures, latest first
  failure ID                                       one failure: headers and body
  groups [FILTER]                                  open failures by cause
  redrive (--id ID... | FILTER) [--rate N] [--reason TEXT] [--dry-run]
  discard (--id ID... | FILTER) --reason TEXT
  restore (--id ID... | FILTER) [--reason TEXT]
  jobs | job ID | pause-job ID | resume-job ID | cancel-job ID
  pause-queue QUEUE [--reason TEXT] | resume-queue QUEUE | paused
  audit [--limit N] [--after CURSOR]
  replay [--queue NAME] [--from error|skipped|outbox] [--message-id ID]...
                      move what a queue set aside back to it, through the broker
                      (without the failures table); `--from outbox` revives dead
                      outbox rows

FILTER: --queue Q --kind error|skipped|dead_outbox --status open|redriving|redriven|discarded
        --type T --fingerprint F --since TIME --until TIME --text TEXT
Settings as the service reads them: config/ (or INBOX_CONFIG_DIR), INBOX_ENV, INBOX__SECTION__KEY.";

type Failed = Box<dyn std::error::Error>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inbox-ops: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The command line, read: the command, its one positional argument, its
/// options (repeatable), and its switches.
struct Line {
    command: String,
    positional: Option<String>,
    options: Vec<(String, String)>,
    dry_run: bool,
}

/// The options that take a value.
const OPTIONS: &[&str] = &[
    "--as",
    "--queue",
    "--kind",
    "--status",
    "--type",
    "--fingerprint",
    "--since",
    "--until",
    "--text",
    "--limit",
    "--after",
    "--id",
    "--rate",
    "--reason",
    "--from",
    "--message-id",
];

fn parse(args: Vec<String>) -> Result<Line, Failed> {
    let mut args = args.into_iter();
    let mut line = Line {
        command: String::new(),
        positional: None,
        options: Vec::new(),
        dry_run: false,
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => return Err(USAGE.into()),
            "--dry-run" => line.dry_run = true,
            option if OPTIONS.contains(&option) => {
                let value = args.next().ok_or_else(|| format!("{option} needs a value"))?;
                line.options.push((option.to_owned(), value));
            }
            unknown if unknown.starts_with('-') => {
                return Err(format!("unknown option `{unknown}`\n\n{USAGE}").into());
            }
            word if line.command.is_empty() => line.command = word.to_owned(),
            word if line.positional.is_none() => line.positional = Some(word.to_owned()),
            extra => return Err(format!("unexpected `{extra}`\n\n{USAGE}").into()),
        }
    }
    if line.command.is_empty() {
        return Err(USAGE.into());
    }
    Ok(line)
}

impl Line {
    fn option(&self, name: &str) -> Option<&str> {
        self.options
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn all(&self, name: &str) -> Vec<&str> {
        self.options
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    fn filter(&self) -> Result<Filter, Failed> {
        let keys = [
            "queue",
            "kind",
            "status",
            "type",
            "fingerprint",
            "since",
            "until",
            "text",
        ];
        let pairs: HashMap<String, serde_json::Value> = keys
            .iter()
            .filter_map(|key| {
                self.option(&format!("--{key}"))
                    .map(|v| ((*key).to_owned(), v.into()))
            })
            .collect();
        Ok(serde_json::from_value(serde_json::to_value(pairs)?)?)
    }

    fn selection(&self) -> Result<Selection, Failed> {
        let ids = self.all("--id");
        if ids.is_empty() {
            return Ok(Selection::Filter(self.filter()?));
        }
        let ids = ids
            .iter()
            .map(|id| Uuid::try_parse(id).map_err(|_| format!("--id `{id}` is not an id")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Selection::Ids(ids))
    }

    fn id(&self) -> Result<Uuid, Failed> {
        let text = self
            .positional
            .as_deref()
            .ok_or_else(|| format!("{} takes an ID", self.command))?;
        Ok(Uuid::try_parse(text).map_err(|_| format!("`{text}` is not an id"))?)
    }

    fn number(&self, name: &str, default: i64) -> Result<i64, Failed> {
        match self.option(name) {
            None => Ok(default),
            Some(text) => Ok(text
                .parse()
                .map_err(|_| format!("{name} `{text}` is not a number"))?),
        }
    }
}

fn print(value: impl serde::Serialize) -> Result<(), Failed> {
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

async fn run(args: Vec<String>) -> Result<(), Failed> {
    let line = parse(args)?;
    let settings = rabbit_inbox::Settings::load()?;
    if line.command == "replay" {
        return replay(&line, &settings).await;
    }
    let ops = Operations::new(rabbit_inbox::tools::create_pool(&settings)?, &settings);
    let name = match line.option("--as") {
        Some(name) => name.to_owned(),
        None => format!(
            "cli:{}",
            std::env::var("USER").unwrap_or_else(|_| "unknown".into())
        ),
    };
    let who = Operator::new(name, Role::Admin);
    let reason = line.option("--reason");
    match line.command.as_str() {
        "failures" => print(
            ops.failures(
                &line.filter()?,
                line.option("--after"),
                line.number("--limit", 50)?,
            )
            .await?,
        ),
        "failure" => print(ops.failure(line.id()?).await?),
        "groups" => print(ops.groups(&line.filter()?).await?),
        "redrive" => {
            let rate = line
                .option("--rate")
                .map(str::parse::<i32>)
                .transpose()
                .map_err(|_| "--rate is not a whole number")?;
            print(
                serde_json::json!({ "job": ops.redrive(&who, &line.selection()?, rate, reason, line.dry_run).await? }),
            )
        }
        "discard" => {
            print(serde_json::json!({ "job": ops.discard(&who, &line.selection()?, reason).await? }))
        }
        "restore" => {
            print(serde_json::json!({ "job": ops.restore(&who, &line.selection()?, reason).await? }))
        }
        "jobs" => print(ops.jobs(line.number("--limit", 50)?).await?),
        "job" => print(serde_json::json!({ "job": ops.job(line.id()?).await? })),
        "pause-job" => print(serde_json::json!({ "job": ops.pause_job(&who, line.id()?).await? })),
        "resume-job" => print(serde_json::json!({ "job": ops.resume_job(&who, line.id()?).await? })),
        "cancel-job" => print(serde_json::json!({ "job": ops.cancel_job(&who, line.id()?).await? })),
        "pause-queue" | "resume-queue" => {
            let queue = line.positional.as_deref().ok_or("which queue?")?;
            let pause = line.command == "pause-queue";
            let changed = ops.pause_queue(&who, queue, pause, reason).await?;
            print(serde_json::json!({ "queue": queue, "paused": pause, "changed": changed }))
        }
        "paused" => print(ops.paused_queues().await?),
        "audit" => print(
            ops.audit(line.option("--after"), line.number("--limit", 50)?)
                .await?,
        ),
        other => Err(format!("unknown command `{other}`\n\n{USAGE}").into()),
    }
}

/// Moves messages set aside in `Q.error` or `Q.skipped` (`Q_error`,
/// `Q_skipped`) back to `Q` through the broker, or revives dead outbox
/// rows: for a service that keeps its failures in the broker.
async fn replay(line: &Line, settings: &rabbit_inbox::Settings) -> Result<(), Failed> {
    use rabbit_inbox::tools::{self, SetAside};
    let only = line
        .all("--message-id")
        .iter()
        .map(|id| Uuid::try_parse(id).map_err(|_| format!("--message-id `{id}` is not an id")))
        .collect::<Result<std::collections::HashSet<_>, _>>()?;
    let only = (!only.is_empty()).then_some(&only);
    let from = match line.option("--from") {
        None | Some("error") => SetAside::Error,
        Some("skipped") => SetAside::Skipped,
        Some("outbox") => {
            let pool = tools::create_pool(settings)?;
            let revived = tools::retry_dead(&pool, only).await?;
            return print(serde_json::json!({ "from": "outbox", "revived": revived }));
        }
        Some(other) => return Err(format!("--from `{other}`: expected error, skipped or outbox").into()),
    };
    let queue = match line.option("--queue") {
        Some(queue) => queue.to_owned(),
        None => settings
            .queues
            .first()
            .map(|q| q.name.clone())
            .ok_or("the settings list no [[queues]]: say which with --queue")?,
    };
    let wire = settings.message_bus.wire;
    let connection = tools::connect(settings, "inbox-ops replay").await?;
    let report = tools::replay_on(wire, &connection, &queue, from, only).await?;
    connection.close(200, "done".into()).await?;
    print(serde_json::json!({
        "from": from.queue_on(wire, &queue),
        "to": queue,
        "replayed": report.replayed,
        "left": report.left,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(args: &[&str]) -> Result<Line, Failed> {
        parse(args.iter().map(|a| (*a).to_owned()).collect())
    }

    #[test]
    fn a_mistyped_option_is_refused_by_name() {
        let error = line(&["redrive", "--queu", "q"]).err().unwrap().to_string();
        assert!(error.starts_with("unknown option `--queu`"), "{error}");
        let line = line(&["redrive", "--queue", "q", "--rate", "5", "--dry-run"]).unwrap();
        assert_eq!(line.option("--queue"), Some("q"));
        assert!(line.dry_run);
        assert_eq!(
            line.selection().unwrap(),
            Selection::Filter(Filter {
                queue: Some("q".into()),
                ..Filter::default()
            })
        );
    }
}
