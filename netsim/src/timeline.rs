//! Scripted timelines: `"wifi 5s, offline 10s, fast-4g"` switches the
//! proxy's conditions over time. Each segment is a profile name (or
//! `offline`) and a duration; the last segment has no duration and lasts
//! forever. `reset` (no duration) resets every open connection at that
//! instant: `"wifi 5s, reset, wifi"`.
//!
//! Durations are a number and a unit: `250ms`, `5s`, `1.5s`, `2m`.

use std::str::FromStr;
use std::time::Duration;

use crate::config::NetConfig;
use crate::error::NetsimError;

/// What a segment does.
// A timeline has a handful of segments; boxing would only add noise.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Apply these conditions.
    Conditions(NetConfig),
    /// Reset (RST) every open connection, then go on at once.
    Reset,
}

/// One segment of a timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// What happens when the segment starts.
    pub step: Step,
    /// How long it lasts; `None` only for the last segment (forever) and
    /// for `reset` (an instant).
    pub duration: Option<Duration>,
}

/// A sequence of conditions over time, started by
/// [`ProxyHandle::set_timeline`](crate::ProxyHandle::set_timeline).
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    segments: Vec<Segment>,
    /// The first segment's conditions (checked to exist).
    initial: NetConfig,
}

impl Timeline {
    /// Builds a timeline from segments, checking the same rules as the
    /// parser: at least one segment, the first and last set conditions, every
    /// segment but the last and `reset`s has a duration.
    pub fn new(segments: Vec<Segment>) -> Result<Self, NetsimError> {
        let invalid = |reason: &str| NetsimError::InvalidTimeline {
            timeline: describe(&segments),
            reason: reason.to_string(),
        };
        let initial = Self::check(&segments).map_err(|r| invalid(&r))?;
        Ok(Timeline { segments, initial })
    }

    /// Checks the rules and returns the first conditions.
    fn check(segments: &[Segment]) -> Result<NetConfig, String> {
        let (Some(first), Some(last)) = (segments.first(), segments.last()) else {
            return Err("a timeline needs at least one segment".into());
        };
        let Step::Conditions(initial) = &first.step else {
            return Err("the first segment must be a profile, not `reset`".into());
        };
        if last.step == Step::Reset {
            return Err("the last segment must be a profile, not `reset`".into());
        }
        if last.duration.is_some() {
            return Err("the last segment lasts forever; drop its duration".into());
        }
        for (i, s) in segments.iter().enumerate() {
            match (&s.step, s.duration) {
                (Step::Reset, Some(_)) => {
                    return Err(format!("segment {}: `reset` is an instant", i + 1))
                }
                (Step::Conditions(c), None) if i + 1 < segments.len() => {
                    return Err(format!(
                        "segment {} (`{}`) needs a duration, e.g. `{} 5s`",
                        i + 1,
                        c.name,
                        c.name
                    ))
                }
                (Step::Conditions(c), _) => c
                    .validate()
                    .map_err(|e| format!("segment {}: {e}", i + 1))?,
                _ => {}
            }
        }
        Ok(initial.clone())
    }

    /// A timeline that holds one condition forever.
    pub fn constant(config: NetConfig) -> Self {
        Timeline {
            segments: vec![Segment {
                step: Step::Conditions(config.clone()),
                duration: None,
            }],
            initial: config,
        }
    }

    /// Parses `"wifi 5s, offline 10s, fast-4g"`.
    pub fn parse(text: &str) -> Result<Self, NetsimError> {
        let invalid = |reason: String| NetsimError::InvalidTimeline {
            timeline: text.to_string(),
            reason,
        };
        let mut segments = Vec::new();
        for (i, part) in text.split(',').enumerate() {
            let words: Vec<&str> = part.split_whitespace().collect();
            let (name, duration) = match words.as_slice() {
                [name] => (*name, None),
                [name, d] => (
                    *name,
                    Some(
                        parse_duration(d)
                            .map_err(|r| invalid(format!("segment {}: {r}", i + 1)))?,
                    ),
                ),
                [] => return Err(invalid(format!("segment {} is empty", i + 1))),
                _ => {
                    return Err(invalid(format!(
                        "segment {} `{}` is not `<profile> [<duration>]`",
                        i + 1,
                        part.trim()
                    )))
                }
            };
            let step = if name.eq_ignore_ascii_case("reset") {
                Step::Reset
            } else {
                Step::Conditions(
                    NetConfig::profile(name)
                        .map_err(|e| invalid(format!("segment {}: {e}", i + 1)))?,
                )
            };
            segments.push(Segment { step, duration });
        }
        let initial = Self::check(&segments).map_err(invalid)?;
        Ok(Timeline { segments, initial })
    }

    /// The conditions of the first segment (in force when it starts).
    pub fn initial(&self) -> &NetConfig {
        &self.initial
    }

    /// Checks every segment's conditions (after [`map_conditions`](Self::map_conditions)).
    pub fn validate(&self) -> Result<(), NetsimError> {
        Self::check(&self.segments)
            .map(|_| ())
            .map_err(|reason| NetsimError::InvalidTimeline {
                timeline: describe(&self.segments),
                reason,
            })
    }

    /// The segments in order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Applies `f` to the conditions of every segment (e.g. to add jitter to
    /// all of them).
    pub fn map_conditions(mut self, mut f: impl FnMut(NetConfig) -> NetConfig) -> Self {
        for s in &mut self.segments {
            if let Step::Conditions(c) = &s.step {
                s.step = Step::Conditions(f(c.clone()));
            }
        }
        if let Some(Step::Conditions(c)) = self.segments.first().map(|s| &s.step) {
            self.initial = c.clone();
        }
        self
    }

    /// The conditions in force `elapsed` after the timeline started.
    pub fn config_at(&self, elapsed: Duration) -> &NetConfig {
        let mut start = Duration::ZERO;
        let mut current = &self.initial;
        for s in &self.segments {
            if start > elapsed {
                break;
            }
            if let Step::Conditions(c) = &s.step {
                current = c;
            }
            match s.duration {
                Some(d) => start = start.saturating_add(d),
                None if s.step == Step::Reset => {}
                None => break,
            }
        }
        current
    }

    /// The instants (offsets from the start) at which connections are reset.
    pub fn reset_times(&self) -> Vec<Duration> {
        let mut t = Duration::ZERO;
        let mut out = Vec::new();
        for s in &self.segments {
            if s.step == Step::Reset {
                out.push(t);
            }
            t = t.saturating_add(s.duration.unwrap_or_default());
        }
        out
    }
}

/// `wifi 5s, offline 10s, fast-4g` — the parser's syntax (custom conditions
/// show their name).
fn describe(segments: &[Segment]) -> String {
    segments
        .iter()
        .map(|s| {
            let name = match &s.step {
                Step::Conditions(c) => c.name.as_str(),
                Step::Reset => "reset",
            };
            match s.duration {
                Some(d) => format!("{name} {}ms", d.as_millis()),
                None => name.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

impl std::fmt::Display for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&describe(&self.segments))
    }
}

impl FromStr for Timeline {
    type Err = NetsimError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Timeline::parse(s)
    }
}

/// Parses `250ms`, `5s`, `1.5s`, `2m`, `1h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration `{text}` needs a unit (ms, s, m, h)"))?;
    let (num, unit) = text.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a duration like 5s or 250ms"))?;
    let scale = match unit {
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("unknown unit `{unit}` in `{text}` (ms, s, m, h)")),
    };
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("`{text}`: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_issue_example() {
        let t: Timeline = "wifi 5s, offline 10s, fast-4g".parse().unwrap();
        let names: Vec<_> = t
            .segments()
            .iter()
            .map(|s| match &s.step {
                Step::Conditions(c) => c.name.clone(),
                Step::Reset => "reset".into(),
            })
            .collect();
        assert_eq!(names, ["wifi", "offline", "fast-4g"]);
        assert_eq!(t.segments()[0].duration, Some(Duration::from_secs(5)));
        assert_eq!(t.segments()[1].duration, Some(Duration::from_secs(10)));
        assert_eq!(t.segments()[2].duration, None);
    }

    #[test]
    fn config_at_follows_the_segments_and_the_last_lasts_forever() {
        let t = Timeline::parse("wifi 5s, offline 10s, fast-4g").unwrap();
        let at = |s: f64| t.config_at(Duration::from_secs_f64(s)).name.clone();
        assert_eq!(at(0.0), "wifi");
        assert_eq!(at(4.999), "wifi");
        assert_eq!(at(5.0), "offline");
        assert_eq!(at(14.9), "offline");
        assert_eq!(at(15.0), "fast-4g");
        assert_eq!(at(1e6), "fast-4g");
        assert!(t.config_at(Duration::from_secs(6)).up.blackhole);
    }

    #[test]
    fn reset_is_an_instant() {
        let t = Timeline::parse("lan 2s, reset, 3g 1s, reset, lan").unwrap();
        assert_eq!(
            t.reset_times(),
            [Duration::from_secs(2), Duration::from_secs(3)]
        );
        assert_eq!(t.config_at(Duration::from_millis(1999)).name, "lan");
        assert_eq!(t.config_at(Duration::from_secs(2)).name, "3g");
        assert_eq!(t.config_at(Duration::from_secs(3)).name, "lan");
    }

    #[test]
    fn rejects_bad_timelines_with_reasons() {
        for (text, why) in [
            ("", "empty"),
            ("wifi, lan", "needs a duration"),
            ("wifi 5s", "lasts forever"),
            ("wifi 5s, 5g", "unknown network profile"),
            ("wifi 5, lan", "needs a unit"),
            ("wifi 5x, lan", "unknown unit"),
            ("wifi 5s 3s, lan", "is not"),
            ("reset, lan", "first segment"),
            ("lan 1s, reset", "last segment"),
            ("lan 1s, reset 2s, lan", "instant"),
            ("wifi 5s,, lan", "empty"),
        ] {
            let e = Timeline::parse(text).unwrap_err().to_string();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn displays_in_the_parser_syntax_and_validates_after_mapping() {
        let t = Timeline::parse("wifi 5s, reset, offline 250ms, fast-4g").unwrap();
        assert_eq!(t.to_string(), "wifi 5000ms, reset, offline 250ms, fast-4g");
        assert_eq!(Timeline::parse(&t.to_string()).unwrap(), t);
        assert_eq!(t.initial().name, "wifi");
        assert!(t.validate().is_ok());
        let bad = t.map_conditions(|c| c.with_loss(3.0));
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("loss") && e.contains("wifi 5000ms"), "{e}");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn huge_durations_saturate_instead_of_overflowing() {
        // Each fits a Duration; their sum does not (it used to panic).
        let t = Timeline::parse(
            "wifi 10000000000000000000s, lan 10000000000000000000s, reset, offline",
        )
        .unwrap();
        assert_eq!(t.reset_times(), vec![Duration::MAX]);
        let _ = t.config_at(Duration::MAX);
    }

    #[test]
    fn map_conditions_touches_every_profile() {
        let t = Timeline::parse("wifi 1s, reset, lan")
            .unwrap()
            .map_conditions(|c| c.with_loss(0.25));
        for s in t.segments() {
            if let Step::Conditions(c) = &s.step {
                assert_eq!(c.up.loss, 0.25);
                assert_eq!(c.down.loss, 0.25);
            }
        }
    }
}
