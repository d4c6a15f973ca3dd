//! The tool service (shell; built in its issue).
