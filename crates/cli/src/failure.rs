//! How a command that failed ends: its error chain printed once (as text, or as JSON with
//! `--json`) and an exit code that tells scripts what kind of failure it was.

use std::error::Error;
use std::process::ExitCode;

use crate::AnyError;

/// The exit codes besides 0. Clap's own usage errors exit 2 as well.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    /// Anything not below.
    Failure = 1,
    /// The command line asked for something that cannot be done as asked (a bad key, a
    /// missing `--config`, `release` without `--force`).
    Usage = 2,
    /// The config file is missing or invalid.
    Config = 3,
    /// A shard could not be reached.
    Unavailable = 4,
    /// The lock is held by another owner, or the operator declined.
    Refused = 5,
}

impl Exit {
    fn name(self) -> &'static str {
        match self {
            Exit::Failure => "failure",
            Exit::Usage => "usage",
            Exit::Config => "config",
            Exit::Unavailable => "unavailable",
            Exit::Refused => "refused",
        }
    }
}

/// A failure the command itself decides, with its exit code.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub(crate) struct Failure {
    pub(crate) exit: Exit,
    pub(crate) message: String,
}

/// Ends the command with `message` and `exit`.
pub(crate) fn fail(exit: Exit, message: impl Into<String>) -> AnyError {
    Box::new(Failure {
        exit,
        message: message.into(),
    })
}

/// The exit code of `error`: the first part of its chain that says.
pub(crate) fn exit_of(error: &(dyn Error + 'static)) -> Exit {
    let mut part = Some(error);
    while let Some(e) = part {
        if let Some(f) = e.downcast_ref::<Failure>() {
            return f.exit;
        }
        if e.is::<shardlock::ConfigError>() {
            return Exit::Config;
        }
        if let Some(e) = e.downcast_ref::<shardlock::Error>() {
            use shardlock::Error as E;
            return match e {
                E::Config(_) => Exit::Config,
                E::Unavailable { .. } => Exit::Unavailable,
                E::Timeout { .. } | E::LockLost { .. } | E::FenceRejected { .. } => Exit::Refused,
                E::InvalidKey { .. } | E::InvalidArgument { .. } => Exit::Usage,
                _ => Exit::Failure,
            };
        }
        part = e.source();
    }
    Exit::Failure
}

/// Prints `error` on stderr, each part of its chain once, and gives the exit code.
///
/// Text: `error: …` then `  caused by: …` per source. JSON (`--json`): one object,
/// `{"error": {"message", "causes", "kind", "exit_code"}}`, so that a script reading the
/// command's JSON gets its failures in the same form.
pub(crate) fn report(error: &AnyError, json: bool) -> ExitCode {
    let error: &(dyn Error + 'static) = error.as_ref();
    let exit = exit_of(error);
    let mut parts = shardlock::Report(error).parts().into_iter();
    let message = parts.next().unwrap_or_default();
    let causes: Vec<String> = parts.collect();
    if json {
        let value = serde_json::json!({
            "error": {
                "message": message,
                "causes": causes,
                "kind": exit.name(),
                "exit_code": exit as u8,
            }
        });
        eprintln!("{value}");
    } else {
        // Parts may quote what a shard or a file holds: escaped, as keys and owners are.
        eprintln!("error: {}", crate::output::shown(&message));
        for cause in &causes {
            eprintln!("  caused by: {}", crate::output::shown(cause));
        }
    }
    ExitCode::from(exit as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_part_of_the_chain_that_says_decides() {
        let unavailable: AnyError = Box::new(shardlock::Error::Unavailable {
            shard: "s1".into(),
            source: shardlock::BackendError::timeout("no answer"),
        });
        assert_eq!(exit_of(unavailable.as_ref()), Exit::Unavailable);
        let mut bad = shardlock::ConfigError::default();
        bad.message = "bad".into();
        let config: AnyError = Box::new(shardlock::Error::Config(bad));
        assert_eq!(exit_of(config.as_ref()), Exit::Config);
        let declined = fail(Exit::Refused, "not released");
        assert_eq!(exit_of(declined.as_ref()), Exit::Refused);
        let io: AnyError = Box::new(std::io::Error::other("disk"));
        assert_eq!(exit_of(io.as_ref()), Exit::Failure);
    }
}
