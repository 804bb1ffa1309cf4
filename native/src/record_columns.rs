//! `record_columns`: a batch of records as the column buffers of records.parquet
//! (`testbed.metrics.columnar`), each read off the records in one pass: what the Python way builds
//! field by field through lists and NumPy arrays, a fifth of a long simulated run's writing. The
//! records are settled (made what records.csv reads back) or, with `settle`, their values are
//! stored as settling would make them (floats and stamps to the microsecond, as "%.6f" reads back;
//! a text longer than the cut gives None) and the records left as they are.
//!
//! Each field's values are laid out as Arrow holds them: a float's or stamp's little-endian
//! doubles, an int's 64-bit integers, a bool's bits (least significant first), a text's UTF-8
//! bytes with 32-bit offsets. A value of any other type than its column's (an int where a float is
//! declared, a subclass, a lone surrogate, an int past 64 bits) or texts past a 32-bit offset give
//! None: the caller builds that batch the Python way, which converts or refuses it as it always has.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::record_rows::written_value;

/// How values are laid out: as they are (settled records), or as settling would make them.
struct Settle {
    on: bool,
    max_chars: usize,
    scratch: String,
}

/// `v` if it is exactly a `str` (not a subclass).
pub fn text<'a>(v: &'a Bound<'_, PyAny>) -> Option<&'a Bound<'a, PyString>> {
    if !v.is_exact_instance_of::<PyString>() {
        return None;
    }
    v.cast::<PyString>().ok()
}

/// Texts as Arrow holds them: their UTF-8 bytes end to end and each one's end as a 32-bit offset.
pub struct Texts {
    data: Vec<u8>,
    offsets: Vec<u8>,
}

impl Default for Texts {
    fn default() -> Self {
        Texts { data: Vec::new(), offsets: 0i32.to_le_bytes().to_vec() }
    }
}

impl Texts {
    /// None past a 32-bit offset.
    pub fn push(&mut self, text: &str) -> Option<()> {
        self.data.extend_from_slice(text.as_bytes());
        let end = i32::try_from(self.data.len()).ok()?;
        self.offsets.extend_from_slice(&end.to_le_bytes());
        Some(())
    }

    /// (data, offsets) as bytes.
    pub fn into_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        PyTuple::new(py, [PyBytes::new(py, &self.data), PyBytes::new(py, &self.offsets)])
    }
}

enum Buffer {
    Doubles(Vec<u8>),
    Ints(Vec<u8>),
    Bits(Vec<u8>),
    Texts(Texts),
}

fn buffer(kind: &str, n: usize) -> PyResult<Buffer> {
    Ok(match kind {
        "float" => Buffer::Doubles(Vec::with_capacity(n * 8)),
        "int" => Buffer::Ints(Vec::with_capacity(n * 8)),
        "bool" => Buffer::Bits(vec![0; n.div_ceil(8)]),
        "str" => Buffer::Texts(Texts::default()),
        _ => return Err(pyo3::exceptions::PyValueError::new_err(format!("unknown column type {kind:?}"))),
    })
}

/// `v` appended as row `row` of `buf`; false: not of the column's type, or with `settle` a text
/// past the cut (the Python way then).
fn push(buf: &mut Buffer, row: usize, v: &Bound<'_, PyAny>, settle: &mut Settle) -> bool {
    match buf {
        Buffer::Doubles(out) => {
            if !v.is_exact_instance_of::<PyFloat>() {
                return false;
            }
            let Ok(f) = v.cast::<PyFloat>() else { return false };
            let x = if settle.on { written_value(f.value(), &mut settle.scratch) } else { f.value() };
            out.extend_from_slice(&x.to_le_bytes());
        }
        Buffer::Ints(out) => {
            if !v.is_exact_instance_of::<PyInt>() {
                return false;
            }
            let Ok(n) = v.extract::<i64>() else { return false };
            out.extend_from_slice(&n.to_le_bytes());
        }
        Buffer::Bits(out) => {
            if !v.is_exact_instance_of::<PyBool>() {
                return false;
            }
            if v.is_truthy().unwrap_or(false) {
                out[row / 8] |= 1 << (row % 8);
            }
        }
        Buffer::Texts(texts) => {
            let Some(Ok(s)) = text(v).map(|s| s.to_str()) else { return false };
            if settle.on && s.chars().count() > settle.max_chars {
                return false;
            }
            if texts.push(s).is_none() {
                return false;
            }
        }
    }
    true
}

/// The columns of `records` (each with the attributes `fields` names and a `times` whose
/// attributes `time_names` names): for each field in order, then each stamp, its buffer as bytes
/// (a text's as (data, offsets)); None where a value is not of its column's type. `settle`: the
/// values as settling would make them, a text of more than `max_chars` characters giving None.
#[pyfunction]
#[pyo3(signature = (records, fields, time_names, settle = false, max_chars = 0))]
pub fn record_columns(
    py: Python<'_>,
    records: &Bound<'_, PyList>,
    fields: Vec<(Bound<'_, PyString>, String)>,
    time_names: Vec<Bound<'_, PyString>>,
    settle: bool,
    max_chars: usize,
) -> PyResult<Option<Py<PyList>>> {
    let mut settle = Settle { on: settle, max_chars, scratch: String::new() };
    let n = records.len();
    let mut bufs = Vec::with_capacity(fields.len() + time_names.len());
    for (_, kind) in &fields {
        bufs.push(buffer(kind, n)?);
    }
    let mut stamps: Vec<Buffer> = time_names.iter().map(|_| Buffer::Doubles(Vec::with_capacity(n * 8))).collect();
    let times = pyo3::intern!(py, "times");
    for (row, rec) in records.iter().enumerate() {
        for ((name, _), buf) in fields.iter().zip(bufs.iter_mut()) {
            if !push(buf, row, &rec.getattr(name)?, &mut settle) {
                return Ok(None);
            }
        }
        let t = rec.getattr(times)?;
        for (name, buf) in time_names.iter().zip(stamps.iter_mut()) {
            if !push(buf, row, &t.getattr(name)?, &mut settle) {
                return Ok(None);
            }
        }
    }
    let out = PyList::empty(py);
    for buf in bufs.into_iter().chain(stamps) {
        match buf {
            Buffer::Doubles(b) | Buffer::Ints(b) | Buffer::Bits(b) => out.append(PyBytes::new(py, &b))?,
            Buffer::Texts(texts) => out.append(texts.into_py(py)?)?,
        }
    }
    Ok(Some(out.unbind()))
}
