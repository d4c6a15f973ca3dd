//! Derived ids, pure functions of their parts: operations (`(run, step, call index)`), model
//! requests (`(run, step, attempt)`), and the child runs, questions, callback keys, approvals and
//! timers derived from an operation or a run.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use super::{ApprovalId, Attempt, CallbackKey, IdError, QuestionId, RunId, StepNo, TimerId, strip};

/// Splits `prefix<run body>_<a>_<b>` into the run id and the two trailing numbers.
fn split_derived(
    kind: &'static str,
    prefix: &'static str,
    s: &str,
) -> Result<(RunId, u32, u32), IdError> {
    let rest = strip(prefix, s)?;
    let malformed = |why| IdError::Malformed {
        kind,
        got: s.chars().take(140).collect(),
        why,
    };
    let mut parts = rest.rsplitn(3, '_');
    let b = parts.next().ok_or_else(|| malformed("missing fields"))?;
    let a = parts.next().ok_or_else(|| malformed("missing fields"))?;
    let run = parts.next().ok_or_else(|| malformed("missing run id"))?;
    let a: u32 = a.parse().map_err(|_| malformed("step is not a number"))?;
    let b: u32 = b
        .parse()
        .map_err(|_| malformed("last field is not a number"))?;
    let run: RunId = format!("{}{run}", RunId::PREFIX).parse()?;
    Ok((run, a, b))
}

/// The identity of one tool operation: `(run, step, call index)`, string form
/// `op_<run body>_<step>_<index>`. Stable across retries, crashes and takeovers; passed to tools and
/// MCP servers as their idempotency key.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct OperationId {
    run: RunId,
    step: StepNo,
    index: u32,
}

impl OperationId {
    pub const PREFIX: &'static str = "op_";

    pub fn new(run: &RunId, step: StepNo, index: u32) -> Self {
        Self {
            run: run.clone(),
            step,
            index,
        }
    }
    pub fn run(&self) -> &RunId {
        &self.run
    }
    pub fn step(&self) -> StepNo {
        self.step
    }
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Where compensation ids start in a step's index space (a step's calls never get near).
    pub const COMPENSATION_BASE: u32 = 1_000_000_000;

    /// The operation that compensates `self` (docs/ARCHITECTURE.md "Compensation"): same run
    /// and step, index [`OperationId::COMPENSATION_BASE`] + `self`'s. Derived from the operation
    /// alone, so whoever decides it names the same one, and an ordinary operation id
    /// everywhere else (the tool runners' records, the confirm queries). `None` for a
    /// compensation (compensations are not compensated) or an index that does not fit.
    pub fn compensation_of(&self) -> Option<OperationId> {
        if self.is_compensation() {
            return None;
        }
        Some(OperationId {
            run: self.run.clone(),
            step: self.step,
            index: Self::COMPENSATION_BASE.checked_add(self.index)?,
        })
    }

    /// Whether this is a compensation's id.
    pub fn is_compensation(&self) -> bool {
        self.index >= Self::COMPENSATION_BASE
    }

    /// The operation a compensation's id compensates.
    pub fn compensated(&self) -> Option<OperationId> {
        self.is_compensation().then(|| OperationId {
            run: self.run.clone(),
            step: self.step,
            index: self.index - Self::COMPENSATION_BASE,
        })
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}_{}_{}",
            Self::PREFIX,
            self.run.body(),
            self.step,
            self.index
        )
    }
}

impl FromStr for OperationId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let (run, step, index) = split_derived("OperationId", Self::PREFIX, s)?;
        Ok(Self {
            run,
            step: StepNo(step),
            index,
        })
    }
}

string_form!(OperationId, "^op_[A-Za-z0-9_-]+_[0-9]+_[0-9]+$", |id| id
    .to_string());

impl RunId {
    /// The child run an operation of `run_agent` starts (docs/ARCHITECTURE.md "Child runs"):
    /// `run_ch` + 32 hex digits of the SHA-256 of the operation id. Derived from the operation
    /// alone, so a writer that takes over after a crash finds the same child (one child per
    /// operation); of fixed length whatever the parent's id.
    pub fn for_child(op: &OperationId) -> RunId {
        use sha2::Digest as _;
        let hash = sha2::Sha256::digest(format!("child:{op}").as_bytes());
        let mut body = String::with_capacity(2 + 32);
        body.push_str("ch");
        for b in hash.iter().take(16) {
            body.push_str(&format!("{b:02x}"));
        }
        RunId(format!("{}{body}", RunId::PREFIX))
    }
}

impl QuestionId {
    /// The question an `ask_user` operation asks: derived from the operation, so a retried commit
    /// asks the same question. Always valid: a run id body has at most 64 characters.
    pub fn for_operation(op: &OperationId) -> Self {
        Self(format!(
            "{}{}_{}_{}",
            Self::PREFIX,
            op.run.body(),
            op.step,
            op.index
        ))
    }
}

impl CallbackKey {
    /// The correlation key of an `await_callback` operation: derived from the operation, so the
    /// run it belongs to can be found from the key alone.
    pub fn for_operation(op: &OperationId) -> Self {
        Self(format!(
            "{}{}_{}_{}",
            Self::PREFIX,
            op.run.body(),
            op.step,
            op.index
        ))
    }

    /// The operation a derived key belongs to (`None` for a key not made by
    /// [`CallbackKey::for_operation`]).
    pub fn operation(&self) -> Option<OperationId> {
        format!("{}{}", OperationId::PREFIX, self.body())
            .parse()
            .ok()
    }
}

impl ApprovalId {
    /// The `version`-th approval request of an operation: derived, so a retried commit asks the
    /// same one, and a fresh request after an invalidation gets a new id.
    pub fn for_operation(op: &OperationId, version: u32) -> Self {
        Self(format!(
            "{}{}_{}_{}_v{version}",
            Self::PREFIX,
            op.run.body(),
            op.step,
            op.index
        ))
    }
}

impl TimerId {
    /// The deadline timer of a run.
    pub fn for_deadline(run: &RunId) -> Self {
        Self(format!("{}deadline_{}", Self::PREFIX, run.body()))
    }

    /// The bound on step `step`'s wait for its model provider: derived, so every wait of the
    /// step (and a retried commit) names the same timer.
    pub fn for_provider_wait(run: &RunId, step: StepNo) -> Self {
        Self(format!("{}provider_{}_{step}", Self::PREFIX, run.body()))
    }

    /// The expiry timer of an approval request.
    pub fn for_approval(approval: &ApprovalId) -> Self {
        Self(format!("{}{}", Self::PREFIX, approval.body()))
    }

    /// The timer of a `wait` operation: derived from the operation, so a retried commit schedules
    /// the same timer.
    pub fn for_operation(op: &OperationId) -> Self {
        Self(format!(
            "{}{}_{}_{}",
            Self::PREFIX,
            op.run.body(),
            op.step,
            op.index
        ))
    }
}

/// The identity of one model call attempt: `(run, step, attempt)`, string form
/// `req_<run body>_<step>_<attempt>`. The key of the stored model response in `kedge_idempotency`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ModelRequestId {
    run: RunId,
    step: StepNo,
    attempt: Attempt,
}

impl ModelRequestId {
    pub const PREFIX: &'static str = "req_";

    pub fn new(run: &RunId, step: StepNo, attempt: Attempt) -> Self {
        Self {
            run: run.clone(),
            step,
            attempt,
        }
    }
    pub fn run(&self) -> &RunId {
        &self.run
    }
    pub fn step(&self) -> StepNo {
        self.step
    }
    pub fn attempt(&self) -> Attempt {
        self.attempt
    }
}

impl fmt::Display for ModelRequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}_{}_{}",
            Self::PREFIX,
            self.run.body(),
            self.step,
            self.attempt
        )
    }
}

impl FromStr for ModelRequestId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let (run, step, attempt) = split_derived("ModelRequestId", Self::PREFIX, s)?;
        Ok(Self {
            run,
            step: StepNo(step),
            attempt: Attempt(attempt),
        })
    }
}

string_form!(ModelRequestId, "^req_[A-Za-z0-9_-]+_[0-9]+_[0-9]+$", |id| {
    id.to_string()
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_ids_are_derived_and_parse_back() {
        let run: RunId = "run_my_client-run_7".parse().expect("valid");
        let op = OperationId::new(&run, StepNo(3), 2);
        assert_eq!(op.to_string(), "op_my_client-run_7_3_2");
        let back: OperationId = op.to_string().parse().expect("parses");
        assert_eq!(back, op);
        assert_eq!(back.run(), &run);
        assert_eq!(back.step(), StepNo(3));
        assert_eq!(back.index(), 2);
        assert!("op_x_1".parse::<OperationId>().is_err());
        assert!("op_x_a_1".parse::<OperationId>().is_err());
        assert!(matches!(
            "run_x_1_1".parse::<OperationId>(),
            Err(IdError::TypeMismatch { .. })
        ));
    }

    #[test]
    fn request_ids_are_derived_and_parse_back() {
        let run = RunId::generate();
        let req = ModelRequestId::new(&run, StepNo(1), Attempt(2));
        let back: ModelRequestId = req.to_string().parse().expect("parses");
        assert_eq!(back, req);
        assert_eq!(back.attempt(), Attempt(2));
    }
}
