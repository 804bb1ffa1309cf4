//! `DecodeBatch`: `testbed.core.engine.decode_batch.DecodeBatch` compiled (continuous batching with
//! BS_max and KV-memory admission; its module docstring says how). The sequences stay the
//! caller's `DecodeSeq` objects; their counts live here while they run, and each object's
//! `generated` is written back when it finishes, leaves, or is listed (`running`, `waiting`).
//! Every float is computed in the Python class's order, so both give the same bits.

use std::collections::VecDeque;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyTuple};

struct Seq {
    obj: Py<PyAny>,
    request_id: String,
    context_tokens: i64,
    output_tokens: i64,
    kv_bytes: i64,
    generated: i64,
}

static ADMISSION_ERROR: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static STEP_RESULT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn python_class(py: Python<'_>, cell: &'static PyOnceLock<Py<PyAny>>, name: &str) -> PyResult<Py<PyAny>> {
    cell.get_or_try_init(py, || Ok(py.import("testbed.core.engine.decode_batch")?.getattr(name)?.unbind()))
        .map(|c| c.clone_ref(py))
}

#[pyclass(module = "testbed_native")]
pub struct DecodeBatch {
    #[pyo3(get)]
    step_time: Py<PyAny>,
    base_s: f64,
    per_seq_s: f64,
    per_context_token_s: f64,
    #[pyo3(get)]
    bs_max: i64,
    #[pyo3(get)]
    kv_capacity: i64,
    #[pyo3(get)]
    time_scale: f64,
    #[pyo3(get)]
    kv_used: i64,
    #[pyo3(get)]
    context: i64,
    waiting_: VecDeque<Seq>,
    running_: Vec<Seq>,
}

impl DecodeBatch {
    fn sync(py: Python<'_>, s: &Seq) -> PyResult<()> {
        s.obj.bind(py).setattr("generated", s.generated)
    }

    fn first(&self) -> f64 {
        (self.base_s + self.per_seq_s * self.running_.len() as f64 + self.per_context_token_s * self.context as f64)
            / self.time_scale
    }

    fn min_left(&self) -> i64 {
        self.running_.iter().map(|s| s.output_tokens - s.generated).min().unwrap_or(0)
    }

    /// `steps` steps: every running sequence's count, and the finished ones taken out (in order).
    fn run_steps(&mut self, steps: i64) -> (Vec<Seq>, Vec<bool>) {
        self.context += steps * self.running_.len() as i64;
        let mut done = Vec::new();
        let mut finished = Vec::with_capacity(self.running_.len());
        for s in self.running_.iter_mut() {
            s.generated += steps;
            finished.push(s.generated >= s.output_tokens);
        }
        if finished.iter().any(|&f| f) {
            let running = std::mem::take(&mut self.running_);
            for (s, &f) in running.into_iter().zip(finished.iter()) {
                if f {
                    self.kv_used -= s.kv_bytes;
                    self.context -= s.context_tokens + s.generated;
                    done.push(s);
                } else {
                    self.running_.push(s);
                }
            }
        }
        (done, finished)
    }

    fn results(&mut self, py: Python<'_>, steps: i64) -> PyResult<Py<PyList>> {
        let before: Vec<Py<PyAny>> = self.running_.iter().map(|s| s.obj.clone_ref(py)).collect();
        let (done, finished) = self.run_steps(steps);
        for s in self.running_.iter().chain(done.iter()) {
            Self::sync(py, s)?;
        }
        let cls = python_class(py, &STEP_RESULT, "StepResult")?;
        let out = PyList::empty(py);
        for (obj, f) in before.into_iter().zip(finished) {
            out.append(cls.bind(py).call1((obj, f))?)?;
        }
        Ok(out.unbind())
    }
}

#[pymethods]
impl DecodeBatch {
    #[new]
    #[pyo3(signature = (step_time, bs_max, kv_capacity, time_scale = 1.0))]
    fn new(step_time: &Bound<'_, PyAny>, bs_max: i64, kv_capacity: i64, time_scale: f64) -> PyResult<Self> {
        Ok(DecodeBatch {
            base_s: step_time.getattr("base_s")?.extract()?,
            per_seq_s: step_time.getattr("per_seq_s")?.extract()?,
            per_context_token_s: step_time.getattr("per_context_token_s")?.extract()?,
            step_time: step_time.clone().unbind(),
            bs_max,
            kv_capacity,
            time_scale,
            kv_used: 0,
            context: 0,
            waiting_: VecDeque::new(),
            running_: Vec::new(),
        })
    }

    fn submit(&mut self, seq: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = Seq {
            obj: seq.clone().unbind(),
            request_id: seq.getattr("request_id")?.extract()?,
            context_tokens: seq.getattr("context_tokens")?.extract()?,
            output_tokens: seq.getattr("output_tokens")?.extract()?,
            kv_bytes: seq.getattr("kv_bytes")?.extract()?,
            generated: seq.getattr("generated")?.extract()?,
        };
        if s.kv_bytes > self.kv_capacity {
            let py = seq.py();
            let msg = format!(
                "request {} needs {} KV bytes, more than the instance's {}",
                s.request_id, s.kv_bytes, self.kv_capacity
            );
            return Err(PyErr::from_value(
                python_class(py, &ADMISSION_ERROR, "AdmissionError")?.bind(py).call1((msg,))?,
            ));
        }
        self.waiting_.push_back(s);
        Ok(())
    }

    fn admit(&mut self, py: Python<'_>, now: f64) -> PyResult<Py<PyList>> {
        let out = PyList::empty(py);
        while !self.waiting_.is_empty() && (self.running_.len() as i64) < self.bs_max {
            let head = &self.waiting_[0];
            if self.kv_used + head.kv_bytes > self.kv_capacity {
                break;
            }
            let head = self.waiting_.pop_front().expect("not empty");
            head.obj.bind(py).setattr("admitted_at", now)?;
            self.kv_used += head.kv_bytes;
            self.context += head.context_tokens + head.generated;
            out.append(head.obj.bind(py))?;
            self.running_.push(head);
        }
        Ok(out.unbind())
    }

    fn step_duration(&self) -> f64 {
        self.first()
    }

    fn complete_step(&mut self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.results(py, 1)
    }

    fn steps_to_finish(&self) -> i64 {
        self.min_left()
    }

    fn duration_of(&self, steps: i64) -> f64 {
        if steps <= 0 || self.running_.is_empty() {
            return 0.0;
        }
        let n = self.running_.len() as f64;
        let first = self.first();
        let growth = self.per_context_token_s * n / self.time_scale;
        let m = steps as f64;
        m * first + growth * m * (steps - 1) as f64 / 2.0
    }

    fn steps_until(&self, elapsed: f64) -> i64 {
        if elapsed <= 0.0 || self.running_.is_empty() {
            return 0;
        }
        let first = self.first();
        let growth = self.per_context_token_s * self.running_.len() as f64 / self.time_scale;
        let span = |m: i64| (m as f64) * first + growth * (m as f64) * ((m - 1) as f64) / 2.0;
        let mut m: i64 = if growth > 0.0 {
            let b = first - growth / 2.0;
            (((-b + (b * b + 2.0 * growth * elapsed).sqrt()) / growth).ceil() as i64).max(1)
        } else {
            ((elapsed / first).ceil() as i64).max(1)
        };
        while m > 1 && span(m - 1) >= elapsed {
            m -= 1;
        }
        while span(m) < elapsed {
            m += 1;
        }
        m
    }

    fn advance(&mut self, py: Python<'_>, steps: i64) -> PyResult<Py<PyList>> {
        if steps <= 0 {
            return Ok(PyList::empty(py).unbind());
        }
        if steps > self.min_left() {
            return Err(PyValueError::new_err(format!(
                "advance({steps}): a sequence finishes after {} steps",
                self.min_left()
            )));
        }
        self.results(py, steps)
    }

    fn advance_finished(&mut self, py: Python<'_>, steps: i64) -> PyResult<Py<PyList>> {
        if steps <= 0 {
            return Ok(PyList::empty(py).unbind());
        }
        if self.running_.iter().any(|s| s.output_tokens - s.generated < steps) {
            return Err(PyValueError::new_err(format!(
                "advance({steps}): a sequence finishes after {} steps",
                self.min_left()
            )));
        }
        let (done, _) = self.run_steps(steps);
        let out = PyList::empty(py);
        for s in &done {
            Self::sync(py, s)?;
            out.append(s.obj.bind(py))?;
        }
        Ok(out.unbind())
    }

    fn abort(&mut self, py: Python<'_>, request_id: &str) -> PyResult<bool> {
        if let Some(i) = self.running_.iter().position(|s| s.request_id == request_id) {
            let s = self.running_.remove(i);
            self.kv_used -= s.kv_bytes;
            self.context -= s.context_tokens + s.generated;
            Self::sync(py, &s)?;
            return Ok(true);
        }
        if let Some(i) = self.waiting_.iter().position(|s| s.request_id == request_id) {
            self.waiting_.remove(i);
            return Ok(true);
        }
        Ok(false)
    }

    #[getter]
    fn idle(&self) -> bool {
        self.running_.is_empty() && self.waiting_.is_empty()
    }

    #[getter]
    fn n_running(&self) -> usize {
        self.running_.len()
    }

    #[getter]
    fn n_waiting(&self) -> usize {
        self.waiting_.len()
    }

    /// The request id of the first waiting sequence (None: nothing waits).
    #[getter]
    fn head_id(&self) -> Option<&str> {
        self.waiting_.front().map(|s| s.request_id.as_str())
    }

    /// The running sequences (their counts written back), in admission order.
    #[getter]
    fn running(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let out = PyList::empty(py);
        for s in &self.running_ {
            Self::sync(py, s)?;
            out.append(s.obj.bind(py))?;
        }
        Ok(out.unbind())
    }

    /// The waiting sequences, FCFS.
    #[getter]
    fn waiting(&self, py: Python<'_>) -> PyResult<Py<PyTuple>> {
        PyTuple::new(py, self.waiting_.iter().map(|s| s.obj.bind(py))).map(Bound::unbind)
    }
}
