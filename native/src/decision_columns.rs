//! `decision_columns`: a held batch of decision lines as the column buffers of decisions.parquet
//! (`testbed.metrics.columnar.ParquetSeriesFile`), what `testbed.metrics.decision_columns` and
//! the Arrow arrays built from its lists hold: each line's time (wire seconds, rounded to the
//! microsecond as Python's `round(t, 6)`), source, metric, value (a float; an infinite or NaN one
//! NaN) and labels (their count per line, then keys and values as texts).
//!
//! A batch with anything of another shape or type (a sample that is not a three-item tuple or
//! list, a value that is not a float or a 64-bit int, labels that are not a dict of texts, a
//! lone surrogate) or texts past a 32-bit offset gives None, and the caller builds it the Python
//! way, which converts or refuses it as before.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyInt, PyList, PyTuple};

use crate::record_columns::{text, Texts};
use crate::record_rows::written_value;

/// `float(v)` of an exact float or 64-bit int (an int's nearest double, ties to even, as Python
/// converts it); None for anything else.
fn as_float(v: &Bound<'_, PyAny>) -> Option<f64> {
    if v.is_exact_instance_of::<PyFloat>() {
        return Some(v.cast::<PyFloat>().ok()?.value());
    }
    if v.is_exact_instance_of::<PyInt>() {
        return Some(v.extract::<i64>().ok()? as f64);
    }
    None
}

/// The items of an exact list or tuple.
fn items<'py>(v: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(l) = v.cast_exact::<PyList>() {
        return Some(l.iter().collect());
    }
    if let Ok(t) = v.cast_exact::<PyTuple>() {
        return Some(t.iter().collect());
    }
    None
}

#[derive(Default)]
struct Columns {
    ts: Vec<u8>,
    sources: Texts,
    metrics: Texts,
    values: Vec<u8>,
    counts: Vec<u8>,
    keys: Texts,
    texts: Texts,
    labels: i32,
}

impl Columns {
    /// A held line's samples; None where the Python way must build the batch.
    fn line(&mut self, entry: &Bound<'_, PyAny>, speedup: f64, scratch: &mut String) -> Option<()> {
        let entry = items(entry)?;
        let [t, source, samples] = entry.as_slice() else { return None };
        let t = written_value(as_float(t)? / speedup, scratch);
        let source = text(source)?.to_str().ok()?;
        for sample in items(samples)? {
            let [metric, value, labels] = items(&sample)?.try_into().ok()?;
            let v = as_float(&value)?;
            let labels = labels.cast_exact::<PyDict>().ok()?;
            self.ts.extend_from_slice(&t.to_le_bytes());
            self.sources.push(source)?;
            self.metrics.push(text(&metric)?.to_str().ok()?)?;
            let v = if v.is_finite() { v } else { f64::NAN };
            self.values.extend_from_slice(&v.to_le_bytes());
            for (k, x) in labels.iter() {
                self.keys.push(text(&k)?.to_str().ok()?)?;
                self.texts.push(text(&x)?.to_str().ok()?)?;
            }
            self.labels = self.labels.checked_add(i32::try_from(labels.len()).ok()?)?;
            self.counts.extend_from_slice(&self.labels.to_le_bytes());
        }
        Some(())
    }
}

/// The columns of `held` ((paper time, source, samples) as `ParquetSeriesFile` holds them):
/// [ts, (source data, offsets), (metric data, offsets), values, label offsets, (key data,
/// offsets), (value data, offsets)], each a buffer of bytes; None where the Python way must build it.
#[pyfunction]
pub fn decision_columns(py: Python<'_>, held: &Bound<'_, PyList>, speedup: f64) -> PyResult<Option<Py<PyList>>> {
    let mut c = Columns { counts: 0i32.to_le_bytes().to_vec(), ..Columns::default() };
    let mut scratch = String::new();
    for entry in held.iter() {
        if c.line(&entry, speedup, &mut scratch).is_none() {
            return Ok(None);
        }
    }
    let out = PyList::empty(py);
    out.append(PyBytes::new(py, &c.ts))?;
    out.append(c.sources.into_py(py)?)?;
    out.append(c.metrics.into_py(py)?)?;
    out.append(PyBytes::new(py, &c.values))?;
    out.append(PyBytes::new(py, &c.counts))?;
    out.append(c.keys.into_py(py)?)?;
    out.append(c.texts.into_py(py)?)?;
    Ok(Some(out.unbind()))
}
