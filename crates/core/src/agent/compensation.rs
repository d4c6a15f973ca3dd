//! The reversibility declarations of a definition's tools (`policy.<tool>.reversibility`,
//! `compensate`; docs/ARCHITECTURE.md "Compensation").

use super::{AgentDefinition, ApprovalRule, DefinitionError};

impl AgentDefinition {
    /// The reversibility declarations (`policy.<tool>.reversibility`, `compensate`).
    pub(super) fn check_compensation(&self) -> Result<(), DefinitionError> {
        use crate::event::Level;
        let err = |field: String, reason: String| Err(DefinitionError { field, reason });
        for (name, p) in &self.policy {
            match (p.reversibility, &p.compensate) {
                (Some(Level::Undeclared), _) => {
                    return err(
                        format!("policy.{name}.reversibility"),
                        "must be reversible, compensable or irreversible (leave it out for \
                         undeclared)"
                            .into(),
                    );
                }
                (Some(Level::Compensable), None) => {
                    return err(
                        format!("policy.{name}.compensate"),
                        "a compensable tool must name its compensation \
                         (`{\"tool\": …, \"arguments\": …}`)"
                            .into(),
                    );
                }
                (Some(Level::Compensable), Some(c)) => {
                    let field = format!("policy.{name}.compensate.tool");
                    if !self.tools.iter().any(|t| t.name == c.tool) {
                        return err(field, format!("`{}` is not a tool of this agent", c.tool));
                    }
                    if crate::fold::handled_by_step(&c.tool) {
                        return err(
                            field,
                            format!(
                                "`{}` is handled by the step and has no effect to run",
                                c.tool
                            ),
                        );
                    }
                    if self.tool_policy(&c.tool).approval != ApprovalRule::Never {
                        return err(
                            field,
                            format!(
                                "`{}` needs approval, and compensations run without a person",
                                c.tool
                            ),
                        );
                    }
                    if let Some(args) = &c.arguments
                        && let Err(reason) = crate::compensation::check_template(args)
                    {
                        return err(format!("policy.{name}.compensate.arguments"), reason);
                    }
                }
                (_, Some(_)) => {
                    return err(
                        format!("policy.{name}.compensate"),
                        "only with \"reversibility\": \"compensable\"".into(),
                    );
                }
                (Some(Level::Reversible | Level::Irreversible) | None, None) => {}
            }
        }
        Ok(())
    }
}
