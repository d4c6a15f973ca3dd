//! The tenant gateway's schedule requests (`kedge.t.<tenant>.schedules.…`; docs/API.md,
//! "Schedules").

/// What a tenant's schedule request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleVerb {
    List,
    Get,
    Put,
    Pause,
    Resume,
    Delete,
    Trigger,
}

impl ScheduleVerb {
    pub(super) fn of_token(token: &str) -> Option<ScheduleVerb> {
        Some(match token {
            "get" => ScheduleVerb::Get,
            "put" => ScheduleVerb::Put,
            "pause" => ScheduleVerb::Pause,
            "resume" => ScheduleVerb::Resume,
            "delete" => ScheduleVerb::Delete,
            "trigger" => ScheduleVerb::Trigger,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{GatewayRequest, parse_gateway};
    use super::*;

    #[test]
    fn schedule_requests_parse() {
        let (_, r) = parse_gateway("kedge.t.acme.schedules.list").expect("list");
        assert_eq!(
            r,
            GatewayRequest::Schedule {
                verb: ScheduleVerb::List,
                name: String::new()
            }
        );
        let (_, r) = parse_gateway("kedge.t.acme.schedules.morning.pause").expect("pause");
        assert_eq!(
            r,
            GatewayRequest::Schedule {
                verb: ScheduleVerb::Pause,
                name: "morning".into()
            }
        );
        for bad in [
            "kedge.t.acme.schedules",
            "kedge.t.acme.schedules.morning",
            "kedge.t.acme.schedules.morning.explode",
        ] {
            assert!(parse_gateway(bad).is_err(), "{bad}");
        }
    }
}
