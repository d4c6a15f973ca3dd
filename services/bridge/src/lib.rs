//! The bridge service (shell; built in its issue).
