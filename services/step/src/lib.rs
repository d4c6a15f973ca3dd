//! The step service (shell; built in its issue).
