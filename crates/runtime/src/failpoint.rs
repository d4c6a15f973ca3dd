//! Fault injection for the fault tests.
//!
//! - `KEDGE_FAILPOINTS=step.after_model_stored,…` makes the process abort (as abruptly as
//!   `kill -9`, no cleanup) when it reaches a named point ([`hit`]).
//! - `KEDGE_FAILPOINTS=panic:step.drive` makes the code at a panic point ([`panic_point`]) panic
//!   instead, every time; a test running services in-process arms one for a single key (a run
//!   id) and a number of hits with [`arm_panic`]. A panic is what a bug looks like: the service
//!   must contain it (the message is handed back, the process goes on).
//!
//! - A switch ([`fires`]), armed in-process with [`arm`] (or for every key by
//!   `KEDGE_FAILPOINTS=switch:<name>`), makes the code act as a broker that misbehaves or a
//!   write lost in a crash would make it (`step.append_past_input`: an append accepted past an
//!   input; `tool.record_lost`: an operation's record not finished beside its result).
//!
//! The points are named where they are hit; docs/CONFIG.md lists them. With nothing armed a hit
//! costs an atomic load or two, and no lock.

use std::sync::{Mutex, OnceLock};

fn armed() -> &'static [String] {
    static ARMED: OnceLock<Vec<String>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var("KEDGE_FAILPOINTS")
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Aborts the process if `name` is armed.
pub fn hit(name: &str) {
    if armed().iter().any(|a| a == name) {
        eprintln!("kedge: failpoint {name} hit, aborting");
        std::process::abort();
    }
}

/// A panic armed in-process: at `name`, for `key`, `times` more hits.
struct ArmedPanic {
    name: String,
    key: String,
    times: u32,
}

/// Whether [`arm`] was ever called in this process.
static ARMED_IN_PROCESS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn panics() -> &'static Mutex<Vec<ArmedPanic>> {
    static PANICS: OnceLock<Mutex<Vec<ArmedPanic>>> = OnceLock::new();
    PANICS.get_or_init(Mutex::default)
}

/// Arms the panic point `name` for `key` (e.g. a run id): its next `times` hits with that key
/// panic. For tests that run services in this process.
pub fn arm_panic(name: &str, key: &str, times: u32) {
    arm(name, key, times);
}

/// Arms the switch `name` for `key` (e.g. a run id): its next `times` checks with that key
/// ([`fires`]) say yes. For tests that run services in this process.
pub fn arm(name: &str, key: &str, times: u32) {
    ARMED_IN_PROCESS.store(true, std::sync::atomic::Ordering::Release);
    if let Ok(mut p) = panics().lock() {
        p.push(ArmedPanic {
            name: name.to_owned(),
            key: key.to_owned(),
            times,
        });
    }
}

/// Whether the switch `name` is armed for `key` by [`arm`] (one of its hits is used up): for
/// a misbehaviour that no real failure produces on demand (a broker accepting what it should
/// refuse), so the code that must survive it can be tested.
pub fn fires(name: &str, key: &str) -> bool {
    // Armed for every key by the environment (`KEDGE_FAILPOINTS=switch:<name>`): for a test
    // that runs the service as a process.
    if armed()
        .iter()
        .any(|a| a.strip_prefix("switch:") == Some(name))
    {
        return true;
    }
    // Nothing was ever armed in this process (every production process): no lock on the
    // paths that ask (a decision append).
    if !ARMED_IN_PROCESS.load(std::sync::atomic::Ordering::Acquire) {
        return false;
    }
    panics().lock().is_ok_and(|mut p| {
        let hit = p
            .iter_mut()
            .find(|a| a.name == name && a.key == key && a.times > 0);
        match hit {
            Some(a) => {
                a.times -= 1;
                true
            }
            None => false,
        }
    })
}

/// Panics if `name` is armed: for every key by `KEDGE_FAILPOINTS=panic:<name>`, or for `key`
/// by [`arm_panic`] (until its hits are used up).
pub fn panic_point(name: &str, key: &str) {
    let by_env = armed()
        .iter()
        .any(|a| a.strip_prefix("panic:") == Some(name));
    if by_env || fires(name, key) {
        panic!("kedge: failpoint {name} hit for {key}");
    }
}

/// What a caught panic carried, as text (for the log line and the dead letter's reason).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_armed_panic_fires_for_its_key_and_its_number_of_hits() {
        arm_panic("test.point", "run_a", 2);
        panic_point("test.point", "run_b");
        panic_point("other.point", "run_a");
        for _ in 0..2 {
            let r = std::panic::catch_unwind(|| panic_point("test.point", "run_a"));
            assert!(r.is_err());
        }
        panic_point("test.point", "run_a");
    }

    #[test]
    fn an_armed_switch_fires_for_its_key_and_its_number_of_hits() {
        arm("test.switch", "run_a", 2);
        assert!(!fires("test.switch", "run_b"));
        assert!(!fires("other.switch", "run_a"));
        assert!(fires("test.switch", "run_a"));
        assert!(fires("test.switch", "run_a"));
        assert!(!fires("test.switch", "run_a"));
    }
}
