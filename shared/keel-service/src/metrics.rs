//! Prometheus text exposition (format 0.0.4), written by hand: services keep their counters
//! as atomics or in their actor and print them on `GET /metrics`.

/// The `Content-Type` of the text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Appends one metric without labels: its HELP and TYPE lines and the value.
pub fn metric(out: &mut String, name: &str, kind: &str, help: &str, value: f64) {
    header(out, name, kind, help);
    out.push_str(&format!("{name} {value}\n"));
}

/// Appends a metric's HELP and TYPE lines (samples with labels follow with [`sample`]).
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
}

/// Appends one sample with labels, e.g. `name{env="math"} 3`.
pub fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: f64) {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
    out.push_str(&format!("{name}{{{}}} {value}\n", labels.join(",")));
}

fn escape(value: &str) -> String {
    value.replace('\\', r"\\").replace('"', "\\\"").replace('\n', r"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format() {
        let mut out = String::new();
        metric(&mut out, "keel_x_total", "counter", "Things.", 3.0);
        header(&mut out, "keel_y", "gauge", "Per env.");
        sample(&mut out, "keel_y", &[("env", "ma\"th")], 0.5);
        assert_eq!(
            out,
            "# HELP keel_x_total Things.\n# TYPE keel_x_total counter\nkeel_x_total 3\n\
             # HELP keel_y Per env.\n# TYPE keel_y gauge\nkeel_y{env=\"ma\\\"th\"} 0.5\n"
        );
    }
}
