//! `series_lines`: the lines of a batch of held samples, as
//! `testbed.metrics.series_batch.BatchSeriesFile` writes them (the format of
//! `testbed.metrics.series_format`): `{"ts": <t:.6f>, "source": <json>, "metric": "<metric>",
//! "value": <repr(float(value))> or null, "labels": <json.dumps(labels)>}`.
//!
//! A batch this cannot write exactly as the Python does (a sample that is not a (text, float or
//! int, dict) triple, a label that is not text, a text with a lone surrogate, a time that is not
//! a float) gives None, and the caller writes the whole batch the Python way.
//!
//! `repr` of a float is its shortest round-trip digits, which Rust's `{:e}` gives as Python's
//! does wherever they are unique (fewer than 15 of them), laid out as Python lays them out:
//! positional from 1e-4 to below 1e16, with `.0` on a whole number, exponential (`1e+16`,
//! `1.5e-05`) outside. Longer digits can tie, and Python's own `repr` writes those.

use std::fmt::Write;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

/// Shortest digits from this many on may tie: two decimals of n digits equally near x that both
/// read back as x exist only where x / 10^k >= 2^52 for the n-digit integer x / 10^k, so n >= 16.
/// Which of the two Python writes follows its dtoa's own rules: such values take its `repr`.
const TIE_DIGITS: usize = 15;

/// Python's `repr` of a finite float: the fewest digits that read back as x, laid out as Python
/// lays them out; false (nothing written) where the digits could tie and Python must say.
fn push_repr(x: f64, out: &mut String, scratch: &mut String) -> bool {
    if x == 0.0 {
        out.push_str(if x.is_sign_negative() { "-0.0" } else { "0.0" });
        return true;
    }
    scratch.clear();
    let _ = write!(scratch, "{x:e}");
    let (mant, exp) = scratch.split_once('e').expect("{:e} writes an exponent");
    let exp: i32 = exp.parse().expect("{:e} writes an integer exponent");
    let (neg, mant) = match mant.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mant),
    };
    let (lead, rest) = mant.split_at(1);
    let rest = rest.strip_prefix('.').unwrap_or(rest);
    if 1 + rest.len() >= TIE_DIGITS {
        return false;
    }
    let ndigits = 1 + rest.len() as i32;
    let decpt = exp + 1; // digits before the point
    if neg {
        out.push('-');
    }
    if decpt <= -4 || decpt > 16 {
        out.push_str(lead);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.unsigned_abs());
    } else if decpt <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-decpt) as usize));
        out.push_str(lead);
        out.push_str(rest);
    } else if decpt >= ndigits {
        out.push_str(lead);
        out.push_str(rest);
        out.extend(std::iter::repeat_n('0', (decpt - ndigits) as usize));
        out.push_str(".0");
    } else {
        let split = (decpt - 1) as usize;
        out.push_str(lead);
        out.push_str(&rest[..split]);
        out.push('.');
        out.push_str(&rest[split..]);
    }
    true
}

/// `json.encoder.encode_basestring_ascii`: quoted, with `\"`, `\\`, the short escapes and
/// `\uXXXX` for every other control and non-ASCII character (a surrogate pair past U+FFFF).
fn push_json_text(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
        }
    }
    out.push('"');
}

/// `float(value)` of a float or an int (None: another type, or an int no float holds).
fn value_of(v: &Bound<'_, PyAny>) -> Option<f64> {
    if v.is_exact_instance_of::<PyFloat>() {
        return v.cast::<PyFloat>().ok().map(|f| f.value());
    }
    if v.is_exact_instance_of::<PyInt>() {
        // Rounded to nearest, ties to even, as float(int) does; past 64 bits the Python way.
        return v.extract::<i64>().ok().map(|n| n as f64);
    }
    None
}

/// One sample's line after `head` (None: the Python way).
fn push_sample(sample: &Bound<'_, PyAny>, head: &str, out: &mut String, scratch: &mut String) -> Option<()> {
    let t = sample.cast::<PyTuple>().ok()?;
    if !sample.is_exact_instance_of::<PyTuple>() || t.len() != 3 {
        return None;
    }
    let metric = t.get_item(0).ok()?;
    let value = t.get_item(1).ok()?;
    let labels = t.get_item(2).ok()?;
    if !metric.is_exact_instance_of::<PyString>() || !labels.is_exact_instance_of::<PyDict>() {
        return None;
    }
    let metric = metric.cast::<PyString>().ok()?.to_str().ok()?;
    let v = value_of(&value)?;
    out.push_str(head);
    out.push('"');
    out.push_str(metric);
    out.push_str("\", \"value\": ");
    if v.is_finite() {
        if !push_repr(v, out, scratch) {
            out.push_str(PyFloat::new(sample.py(), v).repr().ok()?.to_str().ok()?);
        }
    } else {
        out.push_str("null"); // JSON has no inf/nan: null reads back as nan
    }
    out.push_str(", \"labels\": {");
    let labels = labels.cast::<PyDict>().ok()?;
    for (i, (k, v)) in labels.iter().enumerate() {
        if !k.is_exact_instance_of::<PyString>() || !v.is_exact_instance_of::<PyString>() {
            return None; // json.dumps of other keys and values: the Python way
        }
        if i > 0 {
            out.push_str(", ");
        }
        push_json_text(k.cast::<PyString>().ok()?.to_str().ok()?, out);
        out.push_str(": ");
        push_json_text(v.cast::<PyString>().ok()?.to_str().ok()?, out);
    }
    out.push_str("}}\n");
    Some(())
}

/// The lines of `batch` ([(t_paper, source or None, samples)], as `BatchSeriesFile` holds them)
/// and how many: each time `t_paper / speedup` written "%.6f", the batch's own source by `own`
/// (`, "source": ..., "metric": `), another by name. None: the Python way, for the whole batch.
#[pyfunction]
pub fn series_lines(batch: &Bound<'_, PyList>, speedup: f64, own: &str) -> PyResult<Option<(String, usize)>> {
    let mut out = String::with_capacity(batch.len() * 120);
    let mut head = String::with_capacity(96);
    let mut scratch = String::with_capacity(32);
    let mut lines = 0usize;
    for entry in batch.iter() {
        let Ok(e) = entry.cast::<PyTuple>() else { return Ok(None) };
        if e.len() != 3 {
            return Ok(None);
        }
        let (t_paper, source, samples) = (e.get_item(0)?, e.get_item(1)?, e.get_item(2)?);
        if !t_paper.is_exact_instance_of::<PyFloat>() {
            return Ok(None);
        }
        let t = t_paper.cast::<PyFloat>().map_err(PyErr::from)?.value() / speedup;
        if !t.is_finite() {
            return Ok(None);
        }
        head.clear();
        let _ = write!(head, "{{\"ts\": {t:.6}");
        if source.is_none() {
            head.push_str(own);
        } else {
            let Ok(name) = source.cast::<PyString>() else { return Ok(None) };
            let Ok(name) = name.to_str() else { return Ok(None) };
            head.push_str(", \"source\": ");
            push_json_text(name, &mut head);
            head.push_str(", \"metric\": ");
        }
        let items: Vec<Bound<'_, PyAny>> = if let Ok(l) = samples.cast::<PyList>() {
            l.iter().collect()
        } else if let Ok(t) = samples.cast::<PyTuple>() {
            t.iter().collect()
        } else {
            return Ok(None);
        };
        for s in &items {
            if push_sample(s, &head, &mut out, &mut scratch).is_none() {
                return Ok(None);
            }
            lines += 1;
        }
    }
    Ok(Some((out, lines)))
}
