//! `${VAR}` substitution, done on the text before YAML parsing so that a variable may stand
//! anywhere a value does (a password inside a URL, a port), and secrets stay out of the file.

use super::ConfigError;

/// Replaces `${VAR}` and `${VAR:-default}` from the environment; `$$` stands for `$`.
/// Whole-line comments are left alone, so a commented-out line may name a variable that is
/// not set. An error points at its `${` in the text as written, the text the user edits.
///
/// Only whole-line comments: a trailing `# ...` is substituted like the rest, since telling it
/// from a `#` inside a quoted value would take a YAML parser. The value is pasted as text, not
/// as a YAML scalar: one holding YAML syntax (`: `, ` #`, a leading `*` or `&`, a newline)
/// changes the document, so quote the reference (`'${DB_PASSWORD}'`) when a value may hold
/// such characters (and double a `'` inside it).
pub(super) fn substitute_env(text: &str) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(text.len());
    for (line_no, line) in text.split_inclusive('\n').enumerate() {
        if line.trim_start().starts_with('#') {
            out.push_str(line);
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let tail = &rest[at..];
            if let Some(after) = tail.strip_prefix("$$") {
                out.push('$');
                rest = after;
            } else if let Some(body) = tail.strip_prefix("${") {
                let column = line.len() - tail.len() + 1;
                let err = |message: String| ConfigError {
                    line: Some(line_no + 1),
                    column: Some(column),
                    message,
                    ..ConfigError::default()
                };
                let end = body
                    .find('}')
                    .ok_or_else(|| err("`${` without a closing `}`".to_owned()))?;
                let (name, default) = match body[..end].split_once(":-") {
                    Some((n, d)) => (n, Some(d)),
                    None => (&body[..end], None),
                };
                if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                {
                    return Err(err(format!(
                        "`${{{}}}` is not a valid variable reference",
                        &body[..end]
                    )));
                }
                match (std::env::var(name), default) {
                    (Ok(value), _) => out.push_str(&value),
                    (Err(_), Some(d)) => out.push_str(d),
                    (Err(_), None) => {
                        return Err(err(format!(
                            "environment variable `{name}` is not set (write `${{{name}:-default}}` to allow a default)"
                        )))
                    }
                }
                rest = &body[end + 1..];
            } else {
                out.push('$');
                rest = &tail[1..];
            }
        }
        out.push_str(rest);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, GOOD};

    #[test]
    fn substitutes_environment_variables() {
        std::env::set_var("SHARDLOCK_TEST_PASSWORD", "s3cret");
        let text = GOOD
            .replace("root@", "root:${SHARDLOCK_TEST_PASSWORD}@")
            .replace("33062", "${SHARDLOCK_TEST_NO_SUCH_PORT:-33099}");
        let c = Config::from_yaml_str(&text).unwrap();
        assert!(c.shards[0].url.contains("root:s3cret@"));
        assert!(c.shards[1].url.contains(":33099/"));
        let e = Config::from_yaml_str(&GOOD.replace("33061", "${SHARDLOCK_TEST_UNSET_VAR}"))
            .unwrap_err();
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("SHARDLOCK_TEST_UNSET_VAR"), "{e}");
    }
}
