//! Placing a field path like `shards[1].name` in the YAML text. serde reports where parsing
//! failed, but a validation error only knows its field; this finds the field's line and
//! column so both kinds of error point into the file the same way.

/// One significant line of block YAML: its 1-based number, the indent of its content (list
/// dashes count as indentation) and whether it starts a list item.
struct YamlLine<'a> {
    number: usize,
    indent: usize,
    item: bool,
    content: &'a str,
}

/// The lines [`locate`] walks. A list dash counts as indentation so that an item's first
/// field has the same indent as the fields below it, just as YAML nests them.
fn yaml_lines(text: &str) -> Vec<YamlLine<'_>> {
    text.lines()
        .enumerate()
        .filter_map(|(i, raw)| {
            let trimmed = raw.trim_start();
            if trimmed.is_empty() || trimmed.starts_with('#') || trimmed == "---" {
                return None;
            }
            let mut indent = raw.len() - trimmed.len();
            let mut content = trimmed;
            let mut item = false;
            while let Some(rest) = content.strip_prefix("- ") {
                let rest_trim = rest.trim_start();
                indent += content.len() - rest_trim.len();
                content = rest_trim;
                item = true;
            }
            Some(YamlLine {
                number: i + 1,
                indent,
                item,
                content,
            })
        })
        .collect()
}

/// Finds the line and column of `field` (`a.b[2].c`) in block-style YAML, for validation
/// errors that serde cannot place. Returns `None` where the text is not plain block style.
///
/// Keys are matched as written, unquoted; a map key holding `.` or `[` (a namespace named
/// `a.b`) cannot be told from the path's separators, so such a field is normally not found
/// and its error keeps the field without a line.
pub(super) fn locate(text: &str, field: &str) -> Option<(usize, usize)> {
    let lines = yaml_lines(text);
    let (mut lo, mut hi) = (0usize, lines.len());
    let mut found = None;
    let mut parent_indent: Option<usize> = None;
    for seg in field.split('.') {
        let (key, index) = match seg.find('[') {
            // `name[3]`; any other segment holding `[` is a map key written with one, not
            // found (see above).
            Some(b) => {
                let index = seg[b + 1..].strip_suffix(']')?.parse::<usize>().ok()?;
                (&seg[..b], Some(index))
            }
            None => (seg, None),
        };
        let depth = lines[lo..hi]
            .iter()
            .filter(|l| parent_indent.is_none_or(|p| l.indent > p))
            .map(|l| l.indent)
            .min()?;
        let at = (lo..hi).find(|&i| {
            let l = &lines[i];
            l.indent == depth && (l.content.starts_with(&format!("{key}:")) || l.content == key)
        })?;
        found = Some((lines[at].number, lines[at].indent + 1));
        lo = at + 1;
        hi = (lo..hi).find(|&i| lines[i].indent <= depth).unwrap_or(hi);
        parent_indent = Some(depth);
        if let Some(index) = index {
            let items: Vec<usize> = (lo..hi).filter(|&i| lines[i].item).collect();
            let item_indent = items.iter().map(|&i| lines[i].indent).min()?;
            let items: Vec<usize> = items
                .into_iter()
                .filter(|&i| lines[i].indent == item_indent)
                .collect();
            let start = *items.get(index)?;
            found = Some((lines[start].number, lines[start].indent + 1));
            let end = items.get(index + 1).copied().unwrap_or(hi);
            lo = start;
            hi = end;
            // Just below the item's indent, so its own first field (on the dash line, at
            // `item_indent`) counts as a child like the fields under it.
            parent_indent = Some(item_indent - 1);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, GOOD};

    #[test]
    fn validation_errors_are_located() {
        let text = GOOD.replace("ttl: 5s", "ttl: 0s");
        let e = Config::from_yaml_str(&text).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("namespaces.stock.ttl"));
        assert_eq!((e.line, e.column), (Some(9), Some(5)), "{e}");
        let text = GOOD.replace("name: s2", "name: s1");
        let e = Config::from_yaml_str(&text).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("shards[1].name"));
        assert_eq!(e.line, Some(4), "{e}");
        assert!(e.to_string().starts_with("<config>:4:"), "{e}");
    }

    /// A namespace whose name holds `[` is not found in the text, and placing its error does
    /// not panic (it sliced past the segment's end, or inside a character).
    #[test]
    fn a_namespace_named_with_a_bracket_is_reported_without_a_line() {
        for name in ["q[", "ñ[ñ", "a[1]b", "x[]"] {
            let text = GOOD.replace("  stock:", &format!("  \"{name}\":"));
            assert_ne!(text, GOOD, "the namespace was not renamed");
            let text = text.replace("ttl: 5s", "ttl: 0s");
            let e = Config::from_yaml_str(&text).unwrap_err();
            assert_eq!(
                e.field.as_deref(),
                Some(format!("namespaces.{name}.ttl").as_str()),
                "{e}"
            );
        }
    }
}
