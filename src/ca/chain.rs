//! Splitting PEM text into response elements exactly as istiod does
//! (`util.PemCertBytestoString`), so clients see byte-identical chains.

/// Splits `text` into one element per PEM block, each the original text of
/// the block (including any text before its BEGIN line) with one leading and
/// one trailing `\n` trimmed, then exactly one `\n` appended. Text after the
/// last complete block is dropped.
pub fn split_elements(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(end) = block_end(rest) {
        let raw = &rest[..end];
        let trimmed = raw.strip_suffix('\n').unwrap_or(raw);
        let trimmed = trimmed.strip_prefix('\n').unwrap_or(trimmed);
        out.push(format!("{trimmed}\n"));
        rest = &rest[end..];
    }
    out
}

/// Byte offset just past the first complete PEM block's END line (and its
/// line ending), if there is one.
fn block_end(text: &str) -> Option<usize> {
    let begin = text.find("-----BEGIN ")?;
    let end_marker = begin + text[begin..].find("-----END ")?;
    let close = end_marker + 9 + text[end_marker + 9..].find("-----")? + 5;
    let tail = &text[close..];
    Some(if tail.starts_with("\r\n") {
        close + 2
    } else if tail.starts_with('\n') {
        close + 1
    } else {
        close
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "-----BEGIN CERTIFICATE-----\nQUFB\n-----END CERTIFICATE-----\n";
    const B: &str = "-----BEGIN CERTIFICATE-----\nQkJC\n-----END CERTIFICATE-----\n";

    #[test]
    fn one_element_per_block() {
        assert_eq!(split_elements(&format!("{A}{B}")), vec![A, B]);
    }

    #[test]
    fn blank_line_between_blocks_is_trimmed() {
        assert_eq!(split_elements(&format!("{A}\n{B}")), vec![A, B]);
    }

    #[test]
    fn missing_final_newline_is_added() {
        assert_eq!(split_elements(A.trim_end()), vec![A]);
    }

    #[test]
    fn leading_text_is_kept_trailing_junk_dropped() {
        let got = split_elements(&format!("# intermediate\n{A}junk"));
        assert_eq!(got, vec![format!("# intermediate\n{A}")]);
    }

    #[test]
    fn empty_input_has_no_elements() {
        assert!(split_elements("").is_empty());
    }
}
