//! The report as one HTML file: the page, its style and its script (ours, in `page/`, compiled
//! into the binary) with the data inlined as JSON, so it opens from disk with no network. The
//! JSON sits in a `<script type="application/json">` element; every `<` in it is written as
//! `\u003c`, so no text of the trace (an owner, a stack) can close that element.

use std::io::Write;

use super::Page;

const TEMPLATE: &str = include_str!("page/report.html");
const CSS: &str = include_str!("page/report.css");
const JS: &str = include_str!("page/report.js");

fn escape_html(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Writes the page for `page`, titled `title`; returns the bytes written.
pub fn write(page: &Page, title: &str, out: &mut impl Write) -> std::io::Result<u64> {
    let data = serde_json::to_string(page).map_err(std::io::Error::from)?.replace('<', "\\u003c");
    let title = escape_html(title);
    // The template's placeholders, in the order they appear.
    let mut written = 0u64;
    let mut rest = TEMPLATE;
    while let Some(at) = rest.find("{{") {
        let (before, tail) = rest.split_at(at);
        let end = tail.find("}}").map_or(tail.len(), |e| e + 2);
        let part = match &tail[..end] {
            "{{TITLE}}" => title.as_str(),
            "{{CSS}}" => CSS,
            "{{JS}}" => JS,
            "{{DATA}}" => data.as_str(),
            other => other,
        };
        out.write_all(before.as_bytes())?;
        out.write_all(part.as_bytes())?;
        written += (before.len() + part.len()) as u64;
        rest = &tail[end..];
    }
    out.write_all(rest.as_bytes())?;
    Ok(written + rest.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_text_cannot_close_the_data_element() {
        let page = Page {
            tool: "memscope-bpf",
            version: "0",
            runs: vec![super::super::Run {
                label: "</script><script>alert(1)</script>".into(),
                origin_ns: "0".into(),
                devices: vec![],
                identity: None,
            }],
            compare: vec![],
            ranks: None,
        };
        let mut out = Vec::new();
        write(&page, "<b>t</b>", &mut out).unwrap();
        let html = String::from_utf8(out).unwrap();
        assert_eq!(html.matches("</script>").count(), 2, "only the page's own two script elements end");
        assert!(html.contains("&lt;b&gt;t&lt;/b&gt;"));
        let start = html.find("id=\"memscope-data\">").unwrap() + "id=\"memscope-data\">".len();
        let json = &html[start..start + html[start..].find("</script>").unwrap()];
        let back: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(back["runs"][0]["label"], "</script><script>alert(1)</script>");
    }
}
