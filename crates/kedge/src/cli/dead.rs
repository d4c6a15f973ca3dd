//! `kedge dead list|retry`: the dead letters in KEDGE_REJECTIONS.

use std::process::ExitCode;

use anyhow::bail;
use kedge_app::inputs::InputId;
use kedge_runtime::Runtime;

use super::DeadCmd;
use super::inputs::send_input;

pub(super) async fn dead(rt: &Runtime, cmd: DeadCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        DeadCmd::List { json } => {
            for (seq, r) in kedge_runtime::rejections::dead_letters(&rt.js)
                .await
                .map_err(anyhow::Error::msg)?
            {
                if json {
                    println!("{}", serde_json::json!({"seq": seq, "record": r}));
                    continue;
                }
                let s = |k: &str| r[k].as_str().unwrap_or("?").to_owned();
                println!(
                    "{seq:>8}  {}  {} {}#{}  {}  after {} deliveries: {}",
                    s("at"),
                    s("consumer"),
                    s("stream"),
                    r["seq"],
                    s("subject"),
                    r["deliveries"],
                    s("reason")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        DeadCmd::Retry { seq } => {
            let letters = kedge_runtime::rejections::dead_letters(&rt.js)
                .await
                .map_err(anyhow::Error::msg)?;
            let Some((_, record)) = letters.iter().find(|(s, _)| *s == seq) else {
                bail!("no dead letter at sequence {seq} (see `kedge dead list`)");
            };
            let subject = record["subject"].as_str().unwrap_or_default();
            let Some(parsed) = kedge_core::subjects::parse_event(subject) else {
                bail!(
                    "dead letter {seq} is not a wake of a run (subject `{subject}`); only the \
                     step's dead letters can be retried"
                );
            };
            let run = parsed.run_id;
            let nudge = kedge_core::Input::Nudge(kedge_core::event::Nudge {
                reason: format!("retried by an operator from dead letter {seq}"),
            });
            send_input(rt, &run, nudge, &InputId::dead_retry(&run, seq)).await
        }
    }
}
