//! `RecordRows`: the lines of `records.csv` for a batch of records, as
//! `testbed.metrics.records.format_line` writes them, and (`settle`) each record made what its
//! line reads back as (`testbed.metrics.records.as_written`). A record this cannot write exactly
//! as the csv module would (a text that needs quoting or cutting, a value of another type than
//! its column's) gets None, and the caller writes it the Python way.
//!
//! Floats are written "%.6f" (NaN empty): Rust's fixed-precision formatting is correctly
//! rounded, half to even on exact ties, as Python's is; and the text read back is the float
//! `round(v, 6)` gives, as in `written_line`.

use std::fmt::Write;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString};

const FLOAT: u8 = 0;
const INT: u8 = 1;
const BOOL: u8 = 2;
const STR: u8 = 3;

/// A record's line, its settled float columns and its settled stamps.
type Line = (String, Vec<f64>, Vec<f64>);

struct Column {
    name: Py<PyString>,
    kind: u8,
    timed: bool,
    /// A stamp's place in `time_names` (its settled value is the one its field reads back as).
    stamp: Option<usize>,
}

#[pyclass(module = "testbed_native")]
pub struct RecordRows {
    columns: Vec<Column>,
    time_names: Vec<Py<PyString>>,
    times_cls: Py<PyAny>,
    max_field: usize,
}

fn kind_of(name: &str) -> PyResult<u8> {
    Ok(match name {
        "float" => FLOAT,
        "int" => INT,
        "bool" => BOOL,
        "str" => STR,
        _ => return Err(pyo3::exceptions::PyValueError::new_err(format!("unknown column type {name:?}"))),
    })
}

/// The float's text in a field and the value that text reads back as, or None when it is not
/// a float (an int, say: the Python way keeps it an int when settling).
fn float_text(v: &Bound<'_, PyAny>, out: &mut String) -> Option<f64> {
    if !v.is_exact_instance_of::<PyFloat>() {
        return None;
    }
    let x = v.cast::<PyFloat>().ok()?.value();
    if x.is_nan() {
        return Some(x);
    }
    if let Some(micros) = whole_micros(x) {
        // "%.6f" of the microseconds: the sign (of -0.0 too, as Python writes it), the seconds,
        // six digits.
        let sign = if x.is_sign_negative() { "-" } else { "" };
        let _ = write!(out, "{sign}{}.{:06}", micros / 1_000_000, micros % 1_000_000);
        return Some(micros_back(x, micros));
    }
    let _ = write!(out, "{x:.6}");
    Some(out.parse().unwrap_or(x))
}

/// What x's "%.6f" text reads back as (Python's `round(x, 6)`), without writing the text where
/// `whole_micros` settles it.
pub fn written_value(x: f64, scratch: &mut String) -> f64 {
    if x.is_nan() {
        return x;
    }
    if let Some(micros) = whole_micros(x) {
        return micros_back(x, micros);
    }
    scratch.clear();
    let _ = write!(scratch, "{x:.6}");
    scratch.parse().unwrap_or(x)
}

/// The double nearest micros / 10^6 (what dividing the two exact doubles gives), with x's sign:
/// what the text of x's microseconds reads back as.
fn micros_back(x: f64, micros: u64) -> f64 {
    let back = micros as f64 / 1e6;
    if x.is_sign_negative() {
        -back
    } else {
        back
    }
}

/// |x| in whole microseconds, rounded as "%.6f" rounds (to nearest, ties to even on the exact
/// binary value), where a double's product with 10^6 settles it: that product is within half
/// an ulp of the exact one, so any fraction farther than that from one half rounds alike. None
/// (the exact formatting then) near a tie and past 10^9 s.
fn whole_micros(x: f64) -> Option<u64> {
    let a = x.abs();
    if a >= 1e9 {
        return None;
    }
    let y = a * 1e6;
    let whole = y.floor();
    let frac = y - whole; // exact: whole is y's integer part
    if (frac - 0.5).abs() <= y * 4.0 * f64::EPSILON + f64::MIN_POSITIVE {
        return None;
    }
    Some(whole as u64 + u64::from(frac > 0.5))
}

impl RecordRows {
    /// The record's line, with its settled float columns and times; None: the Python way.
    fn line(&self, py: Python<'_>, rec: &Bound<'_, PyAny>, settle: bool) -> PyResult<Option<Line>> {
        let times = rec.getattr(pyo3::intern!(py, "times"))?;
        let mut line = String::with_capacity(400);
        let mut floats = Vec::new();
        let mut field = String::with_capacity(32);
        // Each stamp's settled value, from its field where the line has one (read and written
        // once); None: not in the line.
        let mut stamps: Vec<Option<f64>> = if settle { vec![None; self.time_names.len()] } else { Vec::new() };
        for (i, c) in self.columns.iter().enumerate() {
            if i > 0 {
                line.push(',');
            }
            let v = if c.timed { times.getattr(c.name.bind(py))? } else { rec.getattr(c.name.bind(py))? };
            match c.kind {
                FLOAT => {
                    field.clear();
                    let Some(back) = float_text(&v, &mut field) else { return Ok(None) };
                    line.push_str(&field);
                    if settle {
                        match c.stamp {
                            Some(k) => stamps[k] = Some(back),
                            None if !c.timed => floats.push(back),
                            None => {}
                        }
                    }
                }
                INT => {
                    if !v.is_exact_instance_of::<PyInt>() {
                        return Ok(None);
                    }
                    let Ok(n) = v.extract::<i64>() else { return Ok(None) };
                    let _ = write!(line, "{n}");
                }
                BOOL => {
                    if !v.is_exact_instance_of::<PyBool>() {
                        return Ok(None);
                    }
                    line.push(if v.is_truthy()? { '1' } else { '0' });
                }
                _ => {
                    if !v.is_exact_instance_of::<PyString>() {
                        return Ok(None);
                    }
                    let s = v.cast::<PyString>().map_err(PyErr::from)?;
                    let Ok(text) = s.to_str() else { return Ok(None) }; // a lone surrogate
                    if text.chars().count() > self.max_field || text.contains([',', '"', '\r', '\n']) {
                        return Ok(None);
                    }
                    line.push_str(text);
                }
            }
        }
        line.push_str("\r\n");
        let mut settled = Vec::new();
        if settle {
            settled.reserve(self.time_names.len());
            for (n, got) in self.time_names.iter().zip(stamps) {
                let back = match got {
                    Some(back) => back,
                    None => {
                        // A stamp records.csv has no column for: settled as a field's would be.
                        let v = times.getattr(n.bind(py))?;
                        if !v.is_exact_instance_of::<PyFloat>() {
                            return Ok(None);
                        }
                        let Ok(f) = v.cast::<PyFloat>() else { return Ok(None) };
                        written_value(f.value(), &mut field)
                    }
                };
                settled.push(back);
            }
        }
        Ok(Some((line, floats, settled)))
    }
}

#[pymethods]
impl RecordRows {
    /// `columns`: (name, type name, is a stamp of `times`) in the file's order; `time_names`:
    /// every field of `times_cls` (StageTimes) in order; `max_field`: the cut of a text.
    #[new]
    fn new(
        columns: Vec<(Bound<'_, PyString>, String, bool)>,
        time_names: Vec<Bound<'_, PyString>>,
        times_cls: Bound<'_, PyAny>,
        max_field: usize,
    ) -> PyResult<Self> {
        let names: Vec<String> = time_names.iter().map(|n| n.to_string()).collect();
        let mut cols = Vec::with_capacity(columns.len());
        for (name, kind, timed) in columns {
            let kind = kind_of(&kind)?;
            let text = name.to_string();
            let stamp = if timed && kind == FLOAT { names.iter().position(|n| *n == text) } else { None };
            cols.push(Column { name: name.intern_self(), kind, timed, stamp });
        }
        Ok(RecordRows {
            columns: cols,
            time_names: time_names.into_iter().map(|n| n.intern_self()).collect(),
            times_cls: times_cls.unbind(),
            max_field,
        })
    }

    /// Each record's line (None where the Python way must write it); with `settle`, each record
    /// given a line is made what that line reads back as.
    #[pyo3(signature = (records, settle = false))]
    fn lines(&self, py: Python<'_>, records: &Bound<'_, PyList>, settle: bool) -> PyResult<Py<PyList>> {
        let out = PyList::empty(py);
        for rec in records.iter() {
            match self.line(py, &rec, settle)? {
                None => out.append(py.None())?,
                Some((line, floats, stamps)) => {
                    if settle {
                        let mut k = 0;
                        for c in &self.columns {
                            if c.kind == FLOAT && !c.timed {
                                rec.setattr(c.name.bind(py), floats[k])?;
                                k += 1;
                            }
                        }
                        rec.setattr(
                            pyo3::intern!(py, "times"),
                            self.times_cls.bind(py).call1(pyo3::types::PyTuple::new(py, stamps)?)?,
                        )?;
                    }
                    out.append(line)?;
                }
            }
        }
        Ok(out.unbind())
    }
}

trait InternSelf {
    fn intern_self(self) -> Py<PyString>;
}

impl InternSelf for Bound<'_, PyString> {
    fn intern_self(self) -> Py<PyString> {
        let py = self.py();
        match self.to_str() {
            Ok(s) => PyString::intern(py, s).unbind(),
            Err(_) => self.unbind(),
        }
    }
}
