//! The reconciler service (shell; built in its issue).
