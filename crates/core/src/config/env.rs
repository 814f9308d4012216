//! `${VAR}` substitution, done on the text before YAML parsing so that a variable may stand
//! anywhere in a value (a password inside a URL, a port), errors keep pointing into the file
//! as written, and secrets stay out of the file.
//!
//! A variable's value is always a scalar, never YAML structure: where pasting it as it is
//! would change the document (a `: `, ` #`, line break or leading indicator in a password),
//! the scalar holding it is written as a double-quoted scalar instead; inside quotes the value
//! is escaped for them.

use super::ConfigError;

/// How a `${` reference sits in its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quoting {
    Plain,
    Double,
    Single,
}

/// Replaces `${VAR}` and `${VAR:-default}` from the environment; `$$` stands for `$`.
/// Comments are left alone, so a commented-out line may name a variable that is not set.
/// An error points at its `${` in the text as written, the text the user edits.
///
/// References are read in block-style YAML scalars on one line: plain, `"…"` or `'…'` (after
/// a tag or an anchor, if any), and in the lines of a block scalar (`|`, `>`), where the value
/// is pasted as it is but may not break the line. One inside a flow collection (`[…]`, `{…}`),
/// on any of its lines, is refused, and so is a `$$` there: its scalar cannot be told apart
/// there without a YAML parser, and neither may reach the config as written.
pub(super) fn substitute_env(text: &str) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(text.len());
    // The indent of the line that opened the block scalar being read, if any.
    let mut block: Option<usize> = None;
    // Where in a flow collection that an earlier line opened the text is.
    let mut flow = Flow::default();
    for (line_no, line) in text.split_inclusive('\n').enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let blank = line.trim().is_empty();
        if flow.depth > 0 {
            refuse_in_flow(line, 0, line_no + 1)?;
            flow.read(line);
            out.push_str(line);
            continue;
        }
        if let Some(opened) = block {
            if blank || indent > opened {
                out.push_str(&substitute_block_line(line, line_no + 1)?);
                continue;
            }
            block = None;
        }
        let (substituted, open) = substitute_line(line, line_no + 1)?;
        out.push_str(&substituted);
        flow = open;
        if opens_block_scalar(line) {
            block = Some(indent);
        }
    }
    Ok(out)
}

/// Whether `line` ends with a block scalar's header (`key: |`, `- >-`, `|2+`), comments aside.
fn opens_block_scalar(line: &str) -> bool {
    let text = match line.find(" #") {
        Some(at) => &line[..at],
        None => line,
    };
    let Some(last) = text.split_whitespace().last() else {
        return false;
    };
    let mut chars = last.chars();
    matches!(chars.next(), Some('|' | '>'))
        && chars.all(|c| c == '-' || c == '+' || c.is_ascii_digit())
        && text.split_whitespace().count() > 1
}

/// A line of a block scalar: every reference replaced by its value as it is (the block takes
/// any character but a line break).
fn substitute_block_line(line: &str, line_no: usize) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let column = line.len() - rest.len() + at + 1;
        let err = |message: String| ConfigError {
            line: Some(line_no),
            column: Some(column),
            message,
            ..ConfigError::default()
        };
        let (value, used) = reference(&rest[at..]).map_err(err)?;
        if value
            .chars()
            .any(|c| matches!(c, '\n' | '\r' | '\u{85}' | '\u{2028}' | '\u{2029}'))
        {
            return Err(err(
                "the value holds a line break, which would end its line of the block scalar"
                    .to_owned(),
            ));
        }
        out.push_str(&value);
        rest = &rest[at + used..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Refuses a reference (`${`, or `$$`) in `line` from byte `from` on: it is inside a flow
/// collection, where values are not substituted. Comments there too: where one starts cannot
/// be told apart from a `#` in a quoted scalar without a YAML parser, and a reference passed
/// over in silence would reach the config as text.
fn refuse_in_flow(line: &str, from: usize, line_no: usize) -> Result<(), ConfigError> {
    let text = &line[from..];
    let at = match (text.find("${"), text.find("$$")) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    match at {
        Some(at) => Err(ConfigError {
            line: Some(line_no),
            column: Some(from + at + 1),
            message: "a `${VAR}` (or `$$`) inside a flow collection (`[…]` or `{…}`) is not \
                      supported; write the list or map in block style"
                .to_owned(),
            ..ConfigError::default()
        }),
        None => Ok(()),
    }
}

/// Where the text is in flow collections: how deep, and inside which quoted scalar, if any
/// (one may go on over lines).
#[derive(Debug, Clone, Copy, Default)]
struct Flow {
    depth: usize,
    quote: Option<u8>,
}

impl Flow {
    /// Reads `text` on: brackets counted outside quoted scalars and comments. A quote opens a
    /// scalar only where one starts (after `[`, `{`, `,`, `:` or at a line's start), so an
    /// apostrophe inside a plain scalar (`don't`) is text.
    fn read(&mut self, text: &str) {
        let bytes = text.as_bytes();
        // The last byte before this one that was not a blank, on this line.
        let mut previous: Option<u8> = None;
        let mut i = 0;
        while i < bytes.len() {
            let c = bytes[i];
            match self.quote {
                Some(b'"') if c == b'\\' => i += 1,
                Some(b'\'') if c == b'\'' && bytes.get(i + 1) == Some(&b'\'') => i += 1,
                Some(q) if c == q => self.quote = None,
                Some(_) => {}
                None => match c {
                    b'"' | b'\'' if matches!(previous, None | Some(b'[' | b'{' | b',' | b':')) => {
                        self.quote = Some(c)
                    }
                    b'#' if i == 0 || matches!(bytes[i - 1], b' ' | b'\t') => return,
                    b'[' | b'{' => self.depth += 1,
                    b']' | b'}' => self.depth = self.depth.saturating_sub(1),
                    _ => {}
                },
            }
            if !matches!(c, b' ' | b'\t' | b'\r' | b'\n') {
                previous = Some(c);
            }
            i += 1;
        }
    }
}

/// One line: its scalars rewritten where they hold references, and where in a flow
/// collection it ends (one opened on it and not closed).
fn substitute_line(line: &str, line_no: usize) -> Result<(String, Flow), ConfigError> {
    let err = |column: usize, message: String| ConfigError {
        line: Some(line_no),
        column: Some(column),
        message,
        ..ConfigError::default()
    };
    let bytes = line.as_bytes();
    let mut out = String::with_capacity(line.len());
    // The plain scalar being read: where it starts in `out`, where the last value replaced in
    // it ends (0 while none was), and whether a `${VAR}` without a default gave it nothing.
    let mut plain: Option<(usize, usize, bool)> = None;
    let mut at_token_start = true;
    let mut quoting = Quoting::Plain;
    let mut i = 0;
    while i < line.len() {
        let c = bytes[i];
        let next = bytes.get(i + 1).copied();
        let blank = |b: Option<u8>| matches!(b, None | Some(b' ' | b'\t' | b'\n' | b'\r'));
        match quoting {
            Quoting::Double if c == b'\\' => {
                let n = line[i..].chars().take(2).map(char::len_utf8).sum::<usize>();
                out.push_str(&line[i..i + n]);
                i += n;
                continue;
            }
            Quoting::Double if c == b'"' => quoting = Quoting::Plain,
            Quoting::Single if c == b'\'' && next == Some(b'\'') => {
                out.push_str("''");
                i += 2;
                continue;
            }
            Quoting::Single if c == b'\'' => quoting = Quoting::Plain,
            Quoting::Double | Quoting::Single => {}
            Quoting::Plain => {
                let after_blank = i == 0 || matches!(bytes[i - 1], b' ' | b'\t');
                if c == b'#' && after_blank {
                    // A comment: the rest of the line as it is.
                    close_plain(&mut out, &mut plain);
                    out.push_str(&line[i..]);
                    return Ok((out, Flow::default()));
                }
                if (c == b':' || (c == b'-' && at_token_start)) && blank(next) {
                    // `key: ` or a list dash: what follows is a new scalar.
                    close_plain(&mut out, &mut plain);
                    out.push(c as char);
                    i += 1;
                    at_token_start = true;
                    continue;
                }
                if at_token_start {
                    match c {
                        b' ' | b'\t' | b'\n' | b'\r' => {}
                        b'!' | b'&' => {
                            // A tag or an anchor: the scalar starts after it.
                            let end = line[i..]
                                .find([' ', '\t', '\n', '\r'])
                                .map_or(line.len(), |n| i + n);
                            out.push_str(&line[i..end]);
                            i = end;
                            continue;
                        }
                        b'"' => quoting = Quoting::Double,
                        b'\'' => quoting = Quoting::Single,
                        b'[' | b'{' => {
                            refuse_in_flow(line, i, line_no)?;
                            out.push_str(&line[i..]);
                            let mut flow = Flow::default();
                            flow.read(&line[i..]);
                            return Ok((out, flow));
                        }
                        _ => plain = Some((out.len(), 0, false)),
                    }
                    at_token_start = blank(Some(c));
                }
            }
        }
        if c == b'$' {
            let (value, used) = reference(&line[i..]).map_err(|m| err(i + 1, m))?;
            match quoting {
                Quoting::Double => out.push_str(&escape_double(&value)),
                Quoting::Single if value.contains(['\n', '\r']) => {
                    return Err(err(
                        i + 1,
                        "the value holds a line break, which a single-quoted scalar cannot; \
                         put the reference in double quotes"
                            .to_owned(),
                    ));
                }
                Quoting::Single => out.push_str(&value.replace('\'', "''")),
                Quoting::Plain => {
                    out.push_str(&value);
                    if let Some((_, value_end, empty_var)) = &mut plain {
                        *value_end = out.len();
                        *empty_var |= value.is_empty() && !line[i..i + used].contains(":-");
                    }
                }
            }
            i += used;
            continue;
        }
        let n = line[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&line[i..i + n]);
        i += n;
    }
    close_plain(&mut out, &mut plain);
    Ok((out, Flow::default()))
}

/// Ends the plain scalar being read. One that held a reference stays as it is when YAML reads
/// it back as the same one-line scalar, else is written double-quoted; one left empty by a
/// `${VAR}` set to nothing is written `""`. Trailing blanks of the
/// file (before a comment or the line's end) stay outside it; a value's own are part of it.
fn close_plain(out: &mut String, plain: &mut Option<(usize, usize, bool)>) {
    let Some((start, value_end, empty_var)) = plain.take() else {
        return;
    };
    if value_end == 0 {
        return;
    }
    let text = out.split_off(start);
    let written = text.trim_end_matches([' ', '\t', '\n', '\r']).len();
    let scalar = &text[..written.max(value_end - start)];
    // Nothing from a `${VAR}` set empty: the empty text (a `key-prefix` of it is refused, not
    // dropped). Only `${VAR:-}` leaves a field unset.
    if scalar.is_empty() && empty_var {
        out.push_str("\"\"");
        out.push_str(&text);
        return;
    }
    if plain_safe(scalar) {
        out.push_str(&text);
    } else {
        out.push('"');
        out.push_str(&escape_double(scalar));
        out.push('"');
        out.push_str(&text[scalar.len()..]);
    }
}

/// Whether `text` reads back as one plain scalar with this very text.
fn plain_safe(text: &str) -> bool {
    // A spelling of null: YAML reads it as an unset field (a password `null` would be none),
    // not as the text.
    if matches!(text, "~" | "null" | "Null" | "NULL") {
        return false;
    }
    let Some(first) = text.chars().next() else {
        // Nothing: read back as null, as an unset optional field is (`${VAR:-}`).
        return true;
    };
    !"-?:,[]{}#&*!|>'\"%@`".contains(first)
        && !first.is_whitespace()
        && !text.ends_with(char::is_whitespace)
        // Any whitespace but a plain space may be a line break to YAML (U+0085, U+2028,
        // U+2029 are) or a tab it refuses.
        && !text.chars().any(|c| c.is_whitespace() && c != ' ')
        && !text.chars().any(char::is_control)
        && !text.contains(": ")
        && !text.contains(" #")
        && !text.ends_with(':')
}

/// `value` escaped for a double-quoted YAML scalar.
fn escape_double(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{85}' => out.push_str("\\N"),
            '\u{2028}' => out.push_str("\\L"),
            '\u{2029}' => out.push_str("\\P"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// The text a `$` at the start of `tail` stands for, and how many bytes it took: `$$` is `$`,
/// `${VAR}` and `${VAR:-default}` the environment's value (the default when `VAR` is unset or,
/// as in a shell, empty), any other `$` itself.
fn reference(tail: &str) -> Result<(String, usize), String> {
    if tail.starts_with("$$") {
        return Ok(("$".to_owned(), 2));
    }
    let Some(body) = tail.strip_prefix("${") else {
        return Ok(("$".to_owned(), 1));
    };
    let end = body
        .find('}')
        .ok_or_else(|| "`${` without a closing `}`".to_owned())?;
    let (name, default) = match body[..end].split_once(":-") {
        Some((n, d)) => (n, Some(d)),
        None => (&body[..end], None),
    };
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(format!(
            "`${{{}}}` is not a valid variable reference",
            &body[..end]
        ));
    }
    let value = match (std::env::var(name), default) {
        (Ok(value), Some(d)) if value.is_empty() => d.to_owned(),
        (Ok(value), _) => value,
        (Err(_), Some(d)) => d.to_owned(),
        (Err(_), None) => {
            return Err(format!(
                "environment variable `{name}` is not set (write `${{{name}:-default}}` to allow a default)"
            ))
        }
    };
    Ok((value, 2 + end + 1))
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

    /// A variable set to a spelling of null is that text, not an unset field: a password
    /// `null` is that password. A variable set to nothing takes its default, as in a shell;
    /// without one it is the empty text (a namespace's `key-prefix` from it is refused, not
    /// dropped: the namespace would share every unprefixed key), and `${VAR:-}` leaves the
    /// field unset.
    #[test]
    fn a_null_value_is_text_and_an_empty_one_takes_its_default() {
        std::env::set_var("SHARDLOCK_TEST_EMPTY", "");
        let e = Config::from_yaml_str(&format!(
            "{GOOD}  billing:\n    key-prefix: ${{SHARDLOCK_TEST_EMPTY}}\n"
        ))
        .unwrap_err();
        assert_eq!(
            e.field.as_deref(),
            Some("namespaces.billing.key-prefix"),
            "{e}"
        );
        let c = Config::from_yaml_str(&format!(
            "{GOOD}  billing:\n    key-prefix: ${{SHARDLOCK_TEST_EMPTY:-}}\n"
        ))
        .unwrap();
        assert_eq!(c.namespace("billing").unwrap().key_prefix, None);
        let c = Config::from_yaml_str(&format!(
            "{GOOD}  billing:\n    key-prefix: ${{SHARDLOCK_TEST_EMPTY:-billing/}}\n"
        ))
        .unwrap();
        let prefix = c.namespace("billing").unwrap().key_prefix.clone();
        assert_eq!(prefix.as_deref(), Some("billing/"));
        for null in ["null", "~", "NULL"] {
            std::env::set_var("SHARDLOCK_TEST_NULL", null);
            let c = Config::from_yaml_str(
                "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:33061/x\n    \
                 password: ${SHARDLOCK_TEST_NULL}\n",
            )
            .unwrap();
            let password = c.shards[0].password.as_ref().map(|p| p.expose());
            assert_eq!(password, Some(null));
        }
    }

    /// Values that are YAML syntax pasted as text would end the scalar (`: `, ` #`), start a
    /// comment, an alias or a flow list, or break the line: each arrives as the scalar itself,
    /// plain, double-quoted or single-quoted, and the fields around it are untouched.
    #[test]
    fn a_value_is_always_one_scalar_never_structure() {
        let nasty = [
            "pa#ss: word # x",
            "*alias",
            "[1, 2]",
            "- item",
            "two\nlines \"quoted\" 'single'",
            "ends with colon:",
            "  padded  ",
            "{a: b}",
            "back\\slash",
        ];
        for (n, value) in nasty.iter().enumerate() {
            let value = value.to_string();
            let var = format!("SHARDLOCK_TEST_NASTY_{n}");
            std::env::set_var(&var, &value);
            for (password, expect_err) in [
                (format!("${{{var}}}"), false),
                (format!("pre-${{{var}}}-post # a comment"), false),
                (format!("\"${{{var}}}\""), false),
                (format!("'${{{var}}}'"), value.contains('\n')),
            ] {
                let text = format!(
                    "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:33061/x\n    \
                     password: {password}\n    weight: 2\n"
                );
                let parsed = Config::from_yaml_str(&text);
                if expect_err {
                    let e = parsed.unwrap_err();
                    assert_eq!(e.line, Some(4), "{e}");
                    continue;
                }
                let c = parsed.unwrap_or_else(|e| panic!("{password} = {value:?}: {e}"));
                let want = if password.starts_with("pre-") {
                    format!("pre-{value}-post")
                } else {
                    value.clone()
                };
                let got = c.shards[0].password.as_ref().map(|p| p.expose().to_owned());
                assert_eq!(got.as_deref(), Some(want.as_str()), "{password}");
                assert_eq!(
                    c.shards[0].weight, 2,
                    "{password}: the next field is intact"
                );
            }
        }
        // A line break YAML knows beyond \n (U+2028) cannot start a sibling key either.
        std::env::set_var("SHARDLOCK_TEST_LS", "x\u{2028}    weight:\u{2028}      7");
        let c = Config::from_yaml_str(
            "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n    password: ${SHARDLOCK_TEST_LS}\n",
        )
        .unwrap();
        let got = c.shards[0].password.as_ref().map(|p| p.expose().to_owned());
        assert_eq!(got.as_deref(), Some("x\u{2028}    weight:\u{2028}      7"));
        assert_eq!(c.shards[0].weight, 1);
        // After a tag the value is the scalar; in a block scalar it is pasted as it is.
        std::env::set_var("SHARDLOCK_TEST_AT", "@abc: #1");
        for (password, want) in [
            ("!!str ${SHARDLOCK_TEST_AT}", "@abc: #1"),
            ("|-\n      ${SHARDLOCK_TEST_AT}", "@abc: #1"),
            (">-\n      pre ${SHARDLOCK_TEST_AT}", "pre @abc: #1"),
        ] {
            let c = Config::from_yaml_str(&format!(
                "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n    password: {password}\n    weight: 2\n"
            ))
            .unwrap_or_else(|e| panic!("{password}: {e}"));
            let got = c.shards[0].password.as_ref().map(|p| p.expose().to_owned());
            assert_eq!(got.as_deref(), Some(want), "{password}");
            assert_eq!(c.shards[0].weight, 2, "{password}");
        }
        // A number stays a number.
        std::env::set_var("SHARDLOCK_TEST_WEIGHT", "3");
        let c = Config::from_yaml_str(
            "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n    weight: ${SHARDLOCK_TEST_WEIGHT}\n",
        )
        .unwrap();
        assert_eq!(c.shards[0].weight, 3);
        // Flow collections are refused, by position.
        let e = Config::from_yaml_str(
            "shards: [{name: s1, url: \"mysql://${SHARDLOCK_TEST_WEIGHT}@h/x\"}]\n",
        )
        .unwrap_err();
        assert_eq!((e.line, e.column), (Some(1), Some(35)), "{e}");
        // Also on a later line of a collection a line opened (`]` in a quoted scalar or a
        // comment does not close it); after it closes, references are read again.
        let e = Config::from_yaml_str(
            "shards: [\n  {name: \"s]1\", # ]\n   url: \"mysql://${SHARDLOCK_TEST_WEIGHT}@h/x\"}]\n",
        )
        .unwrap_err();
        assert_eq!((e.line, e.column), (Some(3), Some(18)), "{e}");
        let c = Config::from_yaml_str(
            "shards: [\n  {name: s1, url: \"mysql://root@127.0.0.1:1/x\"}\n]\nbreaker:\n  probes: ${SHARDLOCK_TEST_WEIGHT}\n",
        )
        .unwrap();
        assert_eq!(c.breaker.probes, 3);
        // Quotes that do not open a scalar (an apostrophe in a plain one) and escaped ones
        // leave the collection closed where it closes: later references are read.
        for flow in [
            "shards: [{name: s1, url: \"mysql://root@127.0.0.1:1/x\", password: \"p\\\"w\"}]\n",
            "shards: [{name: s1, url: \"mysql://root@127.0.0.1:1/x\", password: it's}]\n",
            "shards: [\n  {name: s1, url: 'mysql://root@127.0.0.1:1/x', password: 'it''s ]'}\n]\n",
        ] {
            let c = Config::from_yaml_str(&format!(
                "{flow}breaker:\n  probes: ${{SHARDLOCK_TEST_WEIGHT}}\n"
            ))
            .unwrap_or_else(|e| panic!("{flow}: {e}"));
            assert_eq!(c.breaker.probes, 3, "{flow}");
        }
        // `$$` inside a collection would stay as written: refused like a reference.
        let e =
            Config::from_yaml_str("shards: [\n  {name: s1, url: \"mysql://root:pa$$w@h:1/x\"}]\n")
                .unwrap_err();
        assert_eq!((e.line, e.column), (Some(2), Some(35)), "{e}");
    }
}
