//! From text to a validated [`Config`]: `${VAR}` substitution, serde with the path of the
//! failing field, the `default` namespace, then validation, each error placed in the file.

use std::path::Path;

use super::env::substitute_env;
use super::{Config, ConfigError, DEFAULT_NAMESPACE};

impl Config {
    /// Parses and validates YAML text (after `${VAR}` substitution).
    pub fn from_yaml_str(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, None)
    }

    /// Reads, parses and validates a YAML file.
    pub fn from_yaml_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        Self::parse(&read_file(path)?, Some(path))
    }

    /// Parses and validates YAML text that was read from `path` (errors name the file).
    pub fn from_yaml_text(text: &str, path: &Path) -> Result<Self, ConfigError> {
        Self::parse(text, Some(path))
    }

    /// `path` only names the file in errors: the text is always passed in, so a caller that
    /// keeps the text it read (for reloads, or to start a router) never reads the file twice.
    fn parse(raw: &str, path: Option<&Path>) -> Result<Self, ConfigError> {
        let with_path = |mut e: ConfigError| {
            e.path = path.map(Path::to_owned);
            e
        };
        let text = substitute_env(raw).map_err(with_path)?;
        // Through serde_path_to_error: serde_yaml alone says where parsing stopped but not
        // which field it was filling, and the field is what the user searches for.
        let de = serde_yaml::Deserializer::from_str(&text);
        let mut config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            let inner = e.into_inner();
            let location = inner.location();
            let message = inner.to_string();
            // serde_yaml appends " at line L column C"; we report those separately.
            let message = match message.find(" at line ") {
                Some(at) => message[..at].to_owned(),
                None => message,
            };
            with_path(ConfigError {
                line: location.as_ref().map(|l| l.line()),
                column: location.as_ref().map(|l| l.column()),
                field: (field != ".").then_some(field),
                message,
                path: None,
            })
        })?;
        // Before validation, so the implicit `default` namespace is checked like any other
        // and every lookup of it afterwards can rely on it being there.
        config
            .namespaces
            .entry(DEFAULT_NAMESPACE.to_owned())
            .or_default();
        // Located in the substituted text, the one serde's positions refer to.
        config.validate().map_err(|e| e.located(&text, path))?;
        Ok(config)
    }
}

/// Reads a config file; the error names it.
pub fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError {
        path: Some(path.to_owned()),
        message: format!("cannot read the file: {e}"),
        ..ConfigError::default()
    })
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, GOOD};

    #[test]
    fn unknown_field_names_line_column_and_field() {
        let text = GOOD.replace("    weight: 2\n", "    wieght: 2\n");
        let e = Config::from_yaml_str(&text).unwrap_err();
        assert_eq!(e.line, Some(6), "{e}");
        assert!(e.message.contains("unknown field `wieght`"), "{e}");
        assert_eq!(e.field.as_deref(), Some("shards[1].wieght"), "{e}");
    }

    #[test]
    fn broken_yaml_reports_line_and_column() {
        let e = Config::from_yaml_str("shards:\n  - name: s1\n    url: [oops\n").unwrap_err();
        assert!(e.line.is_some() && e.column.is_some(), "{e}");
    }
}
