//! Agent definitions in the `kedge_agents` KV bucket. The key is the agent's name; each put is a
//! new revision, and the revision a run froze in `run.created` can always be read back.
//!
//! The bucket keeps only the last 64 values of a key (`max_msgs_per_subject` in
//! nats/kv/kedge_agents.json), so a run pinned to an older revision would lose its definition
//! once the agent is edited 64 more times. Each revision is therefore also kept under a key of
//! its own, `<name>.rev.<revision>` ([`revision_key`]; an agent name has no `.`, so such a key is
//! never an agent), which no later edit replaces. [`AgentStore::put`] writes the copy right after
//! the new revision; a put interrupted in between leaves the newest revision without its copy,
//! and the next put copies it first (it is still in the key's history then), so every revision
//! but possibly the current one has its copy, and the current one is the key's value.
//! [`AgentStore::at_revision`] reads the copy, then the history.
//!
//! Copies are never removed by Kedge: a definition is a few KiB written by a person, and one may
//! be needed as long as any unfinished run uses it, and after that to read the run's archive. An
//! admin removes them by hand if ever needed (docs/RUNBOOK.md "Retention").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::kv::{Operation, Store};
use futures::TryStreamExt;
use kedge_core::agent::{AgentDefinition, DefinitionError};
use kedge_core::event::Digest;
use kedge_core::ids::AgentName;
use kedge_core::tools::Contract;

/// Why an agent definition could not be stored or read.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid agent definition: {0}")]
    Invalid(#[from] DefinitionError),
    #[error("no agent named `{0}`")]
    NotFound(AgentName),
    #[error("agent `{name}` has no revision {revision}")]
    NoRevision { name: AgentName, revision: u64 },
    #[error("stored agent `{name}` revision {revision} does not parse: {reason}")]
    Corrupt {
        name: AgentName,
        revision: u64,
        reason: String,
    },
    #[error("{bucket} unavailable: {0}", bucket = kedge_core::subjects::AGENTS_BUCKET)]
    Unavailable(String),
}

/// An agent revision as read, with what every step of its runs checks and uses, each computed
/// once on first use: its digests (against the ones a run froze in `run.created`) and its tool
/// contract.
#[derive(Debug)]
pub struct Revision {
    pub def: Arc<AgentDefinition>,
    /// The prompt's and the tools' digests.
    digests: std::sync::OnceLock<(Digest, Digest)>,
    contract: std::sync::OnceLock<Arc<Contract>>,
}

impl Revision {
    fn new(def: AgentDefinition) -> Self {
        Self {
            def: Arc::new(def),
            digests: std::sync::OnceLock::new(),
            contract: std::sync::OnceLock::new(),
        }
    }

    fn digests(&self) -> &(Digest, Digest) {
        self.digests
            .get_or_init(|| (self.def.prompt_digest(), self.def.tools_digest()))
    }

    /// [`AgentDefinition::prompt_digest`].
    pub fn prompt_digest(&self) -> &Digest {
        &self.digests().0
    }

    /// [`AgentDefinition::tools_digest`].
    pub fn tools_digest(&self) -> &Digest {
        &self.digests().1
    }

    /// The revision's tool contract ([`Contract::of`]).
    pub fn contract(&self) -> Arc<Contract> {
        self.contract
            .get_or_init(|| Contract::of(&self.def))
            .clone()
    }
}

/// Revisions by (name, revision); a revision never changes, so it is cached forever.
type RevisionCache = Arc<Mutex<HashMap<(AgentName, u64), Arc<Revision>>>>;

/// Handle on `kedge_agents`, with a cache of immutable revisions.
#[derive(Clone)]
pub struct AgentStore {
    kv: Store,
    cache: RevisionCache,
}

impl std::fmt::Debug for AgentStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentStore").finish_non_exhaustive()
    }
}

/// The key under which revision `revision` of agent `name` is kept for good.
pub fn revision_key(name: &AgentName, revision: u64) -> String {
    format!("{name}.rev.{revision}")
}

impl AgentStore {
    pub fn new(kv: Store) -> Self {
        Self {
            kv,
            cache: Arc::default(),
        }
    }

    /// Validates and stores a definition; returns its revision.
    pub async fn put(&self, def: &AgentDefinition) -> Result<u64, AgentError> {
        def.validate()?;
        let bytes = serde_json::to_vec(def).map_err(|e| {
            AgentError::Invalid(DefinitionError {
                field: "definition".into(),
                reason: e.to_string(),
            })
        })?;
        // The current revision gets its copy first, if an interrupted put left it without.
        if let Some(current) = self
            .kv
            .entry(def.name.as_str())
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))?
            && current.operation == Operation::Put
        {
            self.keep(&def.name, current.revision, current.value)
                .await?;
        }
        let revision = self
            .kv
            .put(def.name.as_str(), bytes.clone().into())
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))?;
        self.keep(&def.name, revision, bytes.into()).await?;
        Ok(revision)
    }

    /// Writes the copy of a revision unless it is there.
    async fn keep(
        &self,
        name: &AgentName,
        revision: u64,
        value: bytes::Bytes,
    ) -> Result<(), AgentError> {
        let key = revision_key(name, revision);
        let present = self
            .kv
            .entry(key.as_str())
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))?
            .is_some_and(|e| e.operation == Operation::Put);
        if present {
            return Ok(());
        }
        match self.kv.create(key.as_str(), value).await {
            Ok(_) => Ok(()),
            // Written meanwhile by another put.
            Err(e) if e.kind() == async_nats::jetstream::kv::CreateErrorKind::AlreadyExists => {
                Ok(())
            }
            Err(e) => Err(AgentError::Unavailable(e.to_string())),
        }
    }

    fn parse(name: &AgentName, revision: u64, bytes: &[u8]) -> Result<AgentDefinition, AgentError> {
        serde_json::from_slice(bytes).map_err(|e| AgentError::Corrupt {
            name: name.clone(),
            revision,
            reason: e.to_string(),
        })
    }

    /// The current revision of an agent.
    pub async fn latest(
        &self,
        name: &AgentName,
    ) -> Result<(u64, Arc<AgentDefinition>), AgentError> {
        let entry = self
            .kv
            .entry(name.as_str())
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))?;
        match entry {
            Some(e) if e.operation == Operation::Put => {
                // A revision's content never changes: parsed (and its digests and contract
                // computed) once, not per task.
                if let Some(known) = self.known(name, e.revision) {
                    return Ok((e.revision, known.def.clone()));
                }
                let revision =
                    self.remember(name, e.revision, Self::parse(name, e.revision, &e.value)?);
                Ok((e.revision, revision.def.clone()))
            }
            _ => Err(AgentError::NotFound(name.clone())),
        }
    }

    /// The revision as this store already parsed it, if it did.
    fn known(&self, name: &AgentName, revision: u64) -> Option<Arc<Revision>> {
        self.cache
            .lock()
            .ok()
            .and_then(|cache| cache.get(&(name.clone(), revision)).cloned())
    }

    /// A definition at a given revision (what a run froze).
    pub async fn at_revision(
        &self,
        name: &AgentName,
        revision: u64,
    ) -> Result<Arc<AgentDefinition>, AgentError> {
        Ok(self.revision(name, revision).await?.def.clone())
    }

    /// [`AgentStore::at_revision`] with the revision's digests and contract.
    pub async fn revision(
        &self,
        name: &AgentName,
        revision: u64,
    ) -> Result<Arc<Revision>, AgentError> {
        if let Some(known) = self.known(name, revision) {
            return Ok(known);
        }
        // The copy (every revision but possibly the newest has one), then the key's history.
        let copy = self
            .kv
            .entry(revision_key(name, revision))
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))?;
        let entry = match copy {
            Some(e) if e.operation == Operation::Put => Some(e),
            _ => self
                .kv
                .entry_for_revision(name.as_str(), revision)
                .await
                .map_err(|e| AgentError::Unavailable(e.to_string()))?,
        };
        match entry {
            Some(e) if e.operation == Operation::Put => {
                Ok(self.remember(name, revision, Self::parse(name, revision, &e.value)?))
            }
            _ => Err(AgentError::NoRevision {
                name: name.clone(),
                revision,
            }),
        }
    }

    fn remember(&self, name: &AgentName, revision: u64, def: AgentDefinition) -> Arc<Revision> {
        let known = Arc::new(Revision::new(def));
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert((name.clone(), revision), known.clone());
        }
        known
    }

    /// Every key of the bucket (agent names and revision copies).
    async fn keys(&self) -> Result<Vec<String>, AgentError> {
        self.kv
            .keys()
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))?
            .try_collect()
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))
    }

    /// Every agent with its current revision, sorted by name.
    pub async fn list(&self) -> Result<Vec<(AgentName, u64)>, AgentError> {
        let keys = self.keys().await?;
        let mut out = Vec::new();
        for key in keys {
            let Ok(name) = key.parse::<AgentName>() else {
                continue;
            };
            if let Ok((revision, _)) = self.latest(&name).await {
                out.push((name, revision));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The revisions of an agent, oldest first (its version history: the kept copies and the
    /// key's recent history).
    pub async fn history(&self, name: &AgentName) -> Result<Vec<u64>, AgentError> {
        let entries: Vec<_> = self
            .kv
            .history(name.as_str())
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))?
            .try_collect()
            .await
            .map_err(|e| AgentError::Unavailable(e.to_string()))?;
        let mut revisions: std::collections::BTreeSet<u64> = entries
            .into_iter()
            .filter(|e| e.operation == Operation::Put)
            .map(|e| e.revision)
            .collect();
        let prefix = format!("{name}.rev.");
        let keys = self.keys().await?;
        revisions.extend(
            keys.iter()
                .filter_map(|k| k.strip_prefix(prefix.as_str())?.parse::<u64>().ok()),
        );
        Ok(revisions.into_iter().collect())
    }
}
