//! The one error type of configuration, shared by parsing, validation and reloads.

use std::fmt;
use std::path::{Path, PathBuf};

use super::locate::locate;

/// A configuration error: which file, where in it, which field, and what is wrong.
#[derive(Debug, Clone, Default, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub struct ConfigError {
    /// The file, when the config came from one.
    pub path: Option<PathBuf>,
    /// 1-based line.
    pub line: Option<usize>,
    /// 1-based column.
    pub column: Option<usize>,
    /// The field, as a path like `shards[1].url`.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

/// Written `file:line:column: field `f`: message`, the form compilers use, so editors and
/// terminals can jump to the place.
impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "{}", p.display())?,
            None => f.write_str("<config>")?,
        }
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        f.write_str(": ")?;
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)
    }
}

impl ConfigError {
    /// Adds the file and, for an error that names a field, the field's line and column in
    /// `text` (the YAML the config was parsed from). A line already there is kept: serde put it
    /// at the offending token, which is more exact than the line of the field.
    pub fn located(mut self, text: &str, path: Option<&Path>) -> Self {
        if self.line.is_none() {
            if let Some((line, column)) = self.field.as_deref().and_then(|f| locate(text, f)) {
                self.line = Some(line);
                self.column = Some(column);
            }
        }
        if self.path.is_none() {
            self.path = path.map(Path::to_owned);
        }
        self
    }

    /// An error about `field` (a path like `shards[0].url`) with no location yet.
    pub fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: Some(field.into()),
            message: message.into(),
            ..Self::default()
        }
    }
}
