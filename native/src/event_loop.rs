//! `EventLoop`: `testbed.sim.events.EventLoop` compiled: one heap of (t, priority, seq) entries
//! in virtual time, each a callback and its argument; the same order, so the same run.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

struct Entry {
    t: f64,
    priority: i64,
    seq: u64,
    fn_: Py<PyAny>,
    arg: Py<PyAny>,
}

order_by_ord!(Entry);

impl Ord for Entry {
    /// Reversed: `BinaryHeap` is a max-heap and the earliest entry must come out first. Times are
    /// never NaN (`at` refuses one), so comparing them is total.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .t
            .partial_cmp(&self.t)
            .unwrap_or(Ordering::Equal)
            .then(other.priority.cmp(&self.priority))
            .then(other.seq.cmp(&self.seq))
    }
}

#[pyclass(module = "testbed_native")]
pub struct EventLoop {
    #[pyo3(get)]
    pub(crate) now: f64,
    #[pyo3(get)]
    processed: u64,
    heap: BinaryHeap<Entry>,
    seq: u64,
}

impl EventLoop {
    /// `at`, for the other compiled parts (the flow network's events).
    pub(crate) fn push(&mut self, t: f64, priority: i64, fn_: Py<PyAny>, arg: Py<PyAny>) -> PyResult<()> {
        if t.is_nan() {
            return Err(PyValueError::new_err("an event's time is NaN"));
        }
        let t = if t < self.now { self.now } else { t };
        self.seq += 1;
        self.heap.push(Entry { t, priority, seq: self.seq, fn_, arg });
        Ok(())
    }
}

#[pymethods]
impl EventLoop {
    #[new]
    fn new() -> Self {
        EventLoop { now: 0.0, processed: 0, heap: BinaryHeap::new(), seq: 0 }
    }

    /// Run `fn(arg)` at virtual time `t` (never before now).
    #[pyo3(signature = (t, priority, r#fn, arg = None))]
    fn at(&mut self, py: Python<'_>, t: f64, priority: i64, r#fn: Py<PyAny>, arg: Option<Py<PyAny>>) -> PyResult<()> {
        let arg = arg.unwrap_or_else(|| py.None());
        self.push(t, priority, r#fn, arg)
    }

    /// Run events in order until none is left (or the next is after `until`). An exception from
    /// a callback propagates (its event is gone, the rest stay; `processed` is not counted), as does
    /// a signal's (a KeyboardInterrupt, say) noticed between events.
    #[pyo3(signature = (until = f64::INFINITY))]
    fn run(slf: &Bound<'_, Self>, until: f64) -> PyResult<()> {
        let py = slf.py();
        let mut n = 0;
        loop {
            // The loop is not borrowed while a callback runs: callbacks schedule events.
            let e = {
                let mut me = slf.borrow_mut();
                match me.heap.peek() {
                    Some(top) if top.t <= until => {}
                    _ => break,
                }
                let e = me.heap.pop().expect("peeked");
                me.now = e.t;
                e
            };
            e.fn_.call1(py, (e.arg,))?;
            n += 1;
            // Compiled callbacks (the flow network's) run no bytecode, where the interpreter would
            // notice a signal: without this a long stretch of them would not see Ctrl-C, SIGTERM
            // or a test's timeout until it ended.
            if n % 4096 == 0 {
                py.check_signals()?;
            }
        }
        slf.borrow_mut().processed += n;
        Ok(())
    }

    #[getter]
    fn pending(&self) -> usize {
        self.heap.len()
    }
}
