//! The timer service (shell; built in its issue).
