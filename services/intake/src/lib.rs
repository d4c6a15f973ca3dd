//! The intake service (shell; built in its issue).
