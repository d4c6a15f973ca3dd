//! Kedge's end-to-end tests, one test binary: each module drives the real services (in this
//! process through the harness, or as `kedge serve` processes) against nats-servers the test
//! kit starts. One binary instead of one per file: the services are linked once, not once per
//! suite (docs/ARCHITECTURE.md "Tests"). Run one suite with `cargo test -p kedge --test e2e
//! <module>::`, e.g. `cargo test -p kedge --test e2e partition::`.

mod bridge_support;
mod common;
#[path = "support/compose.rs"]
mod compose;

mod agent_loop;
mod ambiguous;
mod approvals;
mod blobs;
mod bridge_api;
mod bridge_blobs;
mod bridge_browser;
mod bridge_quota;
mod bridge_slowloris;
mod bridge_sse;
mod bridge_waits;
mod callbacks;
mod cancel;
mod child_runs;
mod claims;
mod cli_existing;
mod cli_watch;
mod cluster_topology;
mod compensation;
mod concurrency;
mod console_browser;
mod context_window;
mod dead_letters;
mod demo;
mod deploy_compose;
mod examples;
mod fairness;
mod forged;
mod gates;
mod health;
mod hostile;
mod inline_tools;
mod leases;
mod mcp;
mod metrics;
mod model_settings;
mod partition;
mod projection;
mod provider_outage;
mod quotas;
mod real_model;
mod reconciler;
mod retention;
mod retention_service;
mod runbook;
mod sandbox;
mod schedules;
mod secured;
mod sensitive;
mod structured_output;
mod takeover;
mod timers;
mod tool_contract;
mod tool_retries;
mod traces;
mod upgrade;
