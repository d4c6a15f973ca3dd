//! `kedge demo` from the README works: the plain run and the crash run both exit 0.

use std::process::Command;
use std::time::{Duration, Instant};

fn run_demo(extra: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kedge"))
        .arg("demo")
        .arg("--dir")
        .arg(dir.path().join("demo"))
        .args(["--answer-after", "1", "--timeout", "90"])
        .args(extra)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kedge demo");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kedge demo {extra:?} did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kedge demo {extra:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_demo_succeeds() {
    let out = run_demo(&[]);
    assert!(out.contains("✓ the run succeeded"), "{out}");
    assert!(out.contains("question.answered"), "{out}");
    assert!(out.contains("(1.000 per step)"), "{out}");
}

#[test]
fn the_crash_demo_resumes_without_a_second_model_call() {
    let out = run_demo(&["--crash"]);
    // The worker died between the step's answer and its tool requests: the fresh one requested
    // them, from the journaled answer.
    let crashed = out
        .find("step worker process exited")
        .unwrap_or_else(|| panic!("no crash: {out}"));
    let answered = out
        .find("step.completed")
        .unwrap_or_else(|| panic!("{out}"));
    let requested = out
        .find("tool.requested")
        .unwrap_or_else(|| panic!("{out}"));
    assert!(answered < crashed && crashed < requested, "{out}");
    assert!(out.contains("(1.000 per step)"), "{out}");
    assert!(out.contains("✓ the run succeeded"), "{out}");
}
