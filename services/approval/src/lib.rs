//! The approval service (shell; built in its issue).
