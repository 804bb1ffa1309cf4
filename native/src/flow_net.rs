//! `FlowNet`: `testbed.sim.network.Network` compiled, for runs whose links never change (no
//! faults, no schedule of link changes): links, paths and a fluid of KV bytes with max-min fair
//! sharing, as that module's docstring says. Every float is computed in the Python class's
//! order, so the same bits.
//!
//! Two differences of form, none of result: a path is a handle (`NetPath`: a slot of the
//! network's; a forgotten path's slot takes a new path only once nobody holds its handle, so an
//! old handle still reaches its own path, as a Python `Path` object would),
//! and the callbacks of the byte positions reached during a call (`mark`) run when the call
//! returns, in the order reached, rather than in its middle: they may schedule events but must
//! not call back into the network (the simulator's only schedule the KV's arrival).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use rustc_hash::FxHashMap;

use crate::event_loop::EventLoop;

const IDLE: u8 = 0;
const LIMITED: u8 = 1;
const GREEDY: u8 = 2;
const EPS_BYTES: f64 = 1.0;
const COMPACT: usize = 4;

#[derive(Clone, Copy, Default)]
struct Counter {
    acc: f64,
    rate: f64,
    t: f64,
}

impl Counter {
    fn at(&self, t: f64) -> f64 {
        self.acc + self.rate * (t - self.t)
    }
}

/// (-stream rate, token, path) of a limited path on a link: a min-heap in Python.
struct Lim {
    neg_inflow: f64,
    token: u64,
    path: u32,
}

order_by_ord!(Lim);

impl Ord for Lim {
    fn cmp(&self, o: &Self) -> Ordering {
        // Reversed for BinaryHeap (a max-heap); tokens are unique, so the order is total.
        o.neg_inflow.partial_cmp(&self.neg_inflow).unwrap_or(Ordering::Equal).then(o.token.cmp(&self.token))
    }
}

struct Link {
    capacity: f64,
    counter: usize,
    lim_sum: f64,
    limited: i64,
    heap: BinaryHeap<Lim>,
    greedy: i64,
}

struct Mark {
    pos: f64,
    seq: u64,
    fn_: Py<PyAny>,
    arg: Py<PyAny>,
}

order_by_ord!(Mark);

impl Ord for Mark {
    fn cmp(&self, o: &Self) -> Ordering {
        o.pos.partial_cmp(&self.pos).unwrap_or(Ordering::Equal).then(o.seq.cmp(&self.seq))
    }
}

struct Path {
    gen: u32,
    live: bool,
    src: usize,
    dst: usize,
    links: Vec<usize>,
    counters: Vec<usize>,
    conns: i64,
    chunk: f64,
    conn_rate: f64,
    released: f64,
    sent: f64,
    t: f64,
    inflow: f64,
    rate: f64,
    state: u8,
    k: i64,
    marks: BinaryHeap<Mark>,
    version: u64,
    token: u64,
    due: f64,
}

impl Path {
    fn advance(&mut self, t: f64) -> PyResult<()> {
        let dt = t - self.t;
        if dt > 0.0 {
            self.released += self.inflow * dt;
            self.sent += self.rate * dt;
            if self.sent > self.released {
                self.sent = self.released;
            }
            self.t = t;
        } else if dt < 0.0 {
            return Err(PyRuntimeError::new_err(format!(
                "path {}->{}: time went back ({t} < {})",
                self.src, self.dst, self.t
            )));
        }
        Ok(())
    }

    fn queued(&self, t: f64) -> f64 {
        if self.state != GREEDY {
            return 0.0;
        }
        (self.released + self.inflow * (t - self.t) - self.sent - self.rate * (t - self.t)).max(0.0)
    }
}

/// A path of a `FlowNet`: what the simulator holds while a transfer uses it.
#[pyclass(module = "testbed_native", frozen)]
pub struct NetPath {
    slot: u32,
    gen: u32,
    /// One-way delay (s): the links' parameters never change in a run a `FlowNet` serves.
    #[pyo3(get)]
    delay: f64,
}

type Fired = Vec<(Py<PyAny>, Py<PyAny>)>;
/// The greedy paths' rates, and the level of each saturated link (in the order found).
type Fill = (Vec<(u32, f64)>, Vec<(usize, f64)>);

#[pyclass(module = "testbed_native", subclass)]
pub struct FlowNet {
    loop_: Py<PyAny>,
    native_loop: Option<Py<EventLoop>>,
    net_priority: i64,
    due_cb: Option<Py<PyAny>>,
    chunk: f64,
    conns: i64,
    node_dc: Vec<usize>,
    node_index: FxHashMap<String, usize>,
    links: Vec<Link>,
    counters: Vec<Counter>,
    nic_out: Vec<usize>,
    nic_in: Vec<usize>,
    wan: FxHashMap<(usize, usize), usize>,
    sent_of: Vec<usize>,
    received_of: Vec<usize>,
    route: FxHashMap<(usize, usize), (f64, f64)>,
    by_pair: FxHashMap<(usize, usize), u32>,
    paths: Vec<Path>,
    /// Each slot's handle, the one `path` gives out (its Python references tell when the slot
    /// may take another path).
    handles: Vec<Py<NetPath>>,
    /// Slots of forgotten paths: a slot whose handle nobody else holds takes the next new path;
    /// until then its path lives on as Python's would (an orphan its holders may still use).
    forgotten: Vec<u32>,
    greedy: Vec<u32>,
    greedy_of: Vec<Vec<u32>>,
    tokens: u64,
    seq: u64,
    #[pyo3(get)]
    rebalances: u64,
}

impl FlowNet {
    fn now(&self, py: Python<'_>) -> PyResult<f64> {
        match &self.native_loop {
            Some(l) => Ok(l.borrow(py).now),
            None => self.loop_.bind(py).getattr("now")?.extract(),
        }
    }

    fn at(&mut self, py: Python<'_>, t: f64, arg: Py<PyAny>) -> PyResult<()> {
        let cb = match &self.due_cb {
            Some(cb) => cb.clone_ref(py),
            None => return Err(PyRuntimeError::new_err("FlowNet: bind() was not called")),
        };
        match &self.native_loop {
            Some(l) => l.borrow_mut(py).push(t, self.net_priority, cb, arg),
            None => {
                self.loop_.bind(py).call_method1("at", (t, self.net_priority, cb, arg))?;
                Ok(())
            }
        }
    }

    fn node(&self, id: &str) -> PyResult<usize> {
        self.node_index.get(id).copied().ok_or_else(|| PyValueError::new_err(format!("FlowNet: no node {id:?}")))
    }

    fn slot(&self, p: &NetPath) -> PyResult<u32> {
        let path = &self.paths[p.slot as usize];
        if path.gen != p.gen {
            return Err(PyRuntimeError::new_err("FlowNet: a path handle of another network"));
        }
        Ok(p.slot)
    }

    fn handle(&self, py: Python<'_>, s: u32) -> Py<NetPath> {
        self.handles[s as usize].clone_ref(py)
    }

    /// A slot for a new path: a forgotten path's that no one holds any more and that is still
    /// idle (a holder may have sent on it again, and its events then keep it going, as they
    /// keep a Python `Path` alive), else a new one.
    fn free_slot(&mut self, py: Python<'_>) -> Option<u32> {
        let i = self.forgotten.iter().position(|&s| {
            let p = &self.paths[s as usize];
            self.handles[s as usize].get_refcnt(py) == 1 && p.state == IDLE && p.marks.is_empty() && p.inflow == 0.0
        })?;
        Some(self.forgotten.swap_remove(i))
    }

    // -- links -------------------------------------------------------------------------------

    fn add_limited(&mut self, li: usize, s: u32) {
        let (inflow, token) = {
            let p = &self.paths[s as usize];
            (p.inflow, p.token)
        };
        let lk = &mut self.links[li];
        lk.lim_sum += inflow;
        lk.limited += 1;
        lk.heap.push(Lim { neg_inflow: -inflow, token, path: s });
        if lk.heap.len() > COMPACT * lk.limited as usize + 16 {
            let old = std::mem::take(&mut lk.heap);
            let paths = &self.paths;
            lk.heap = old
                .into_iter()
                .filter(|e| {
                    let p = &paths[e.path as usize];
                    p.state == LIMITED && p.token == e.token
                })
                .collect();
        }
    }

    fn remove_limited(&mut self, li: usize, s: u32) {
        let inflow = self.paths[s as usize].inflow;
        let lk = &mut self.links[li];
        lk.lim_sum -= inflow;
        lk.limited -= 1;
        if lk.limited == 0 {
            lk.lim_sum = 0.0;
            lk.heap.clear();
        }
    }

    fn top_limited(&mut self, li: usize) -> Option<u32> {
        let paths = &self.paths;
        let h = &mut self.links[li].heap;
        while let Some(e) = h.peek() {
            let p = &paths[e.path as usize];
            if p.state == LIMITED && p.token == e.token {
                return Some(e.path);
            }
            h.pop();
        }
        None
    }

    // -- internals -----------------------------------------------------------------------------

    fn k_of(&self, s: u32) -> i64 {
        let p = &self.paths[s as usize];
        let q = p.released - p.sent;
        if self.chunk > 0.0 {
            1.max(p.conns.min((q / p.chunk - 1e-9).ceil() as i64))
        } else {
            p.conns
        }
    }

    fn set_rate(&mut self, s: u32, t: f64, rate: f64) {
        let p = &mut self.paths[s as usize];
        if rate != p.rate {
            let d = rate - p.rate;
            for &c in &p.counters {
                let c = &mut self.counters[c];
                c.acc += c.rate * (t - c.t);
                c.t = t;
                c.rate += d;
                if c.rate < 1e-6 {
                    c.rate = 0.0;
                }
            }
            p.rate = rate;
        }
    }

    fn fire_marks(&mut self, s: u32, fired: &mut Fired) {
        let p = &mut self.paths[s as usize];
        while let Some(m) = p.marks.peek() {
            if m.pos > p.sent + EPS_BYTES {
                break;
            }
            let m = p.marks.pop().expect("peeked");
            fired.push((m.fn_, m.arg));
        }
    }

    fn make_greedy(&mut self, s: u32) {
        if self.paths[s as usize].state == LIMITED {
            for li in self.paths[s as usize].links.clone() {
                self.remove_limited(li, s);
            }
        }
        let k = self.k_of(s);
        let p = &mut self.paths[s as usize];
        p.state = GREEDY;
        p.k = k;
        let src = p.src;
        self.greedy_of[src].push(s);
        self.greedy.push(s);
        for li in self.paths[s as usize].links.clone() {
            self.links[li].greedy += 1;
        }
    }

    fn forget_if_idle(&mut self, s: u32) {
        let p = &self.paths[s as usize];
        if p.state == IDLE && p.marks.is_empty() && p.inflow == 0.0 && p.live {
            let pair = (p.src, p.dst);
            if self.by_pair.get(&pair) == Some(&s) {
                self.by_pair.remove(&pair);
                self.paths[s as usize].live = false;
                self.forgotten.push(s);
            }
        }
    }

    fn leave_greedy(&mut self, s: u32, t: f64) {
        let src = self.paths[s as usize].src;
        if let Some(i) = self.greedy_of[src].iter().position(|&x| x == s) {
            self.greedy_of[src].remove(i);
        }
        if let Some(i) = self.greedy.iter().position(|&x| x == s) {
            self.greedy.remove(i);
        }
        for li in self.paths[s as usize].links.clone() {
            self.links[li].greedy -= 1;
        }
        let p = &mut self.paths[s as usize];
        p.version += 1;
        p.due = f64::INFINITY;
        if p.inflow > 0.0 && p.inflow <= p.conn_rate {
            p.state = LIMITED;
            self.tokens += 1;
            p.token = self.tokens;
            let inflow = p.inflow;
            for li in self.paths[s as usize].links.clone() {
                self.add_limited(li, s);
            }
            self.set_rate(s, t, inflow);
        } else {
            p.state = IDLE;
            self.set_rate(s, t, 0.0);
            self.forget_if_idle(s);
        }
    }

    fn schedule(&mut self, py: Python<'_>, s: u32, t: f64) -> PyResult<()> {
        let p = &mut self.paths[s as usize];
        p.version += 1;
        let q = p.released - p.sent;
        let mut due = f64::INFINITY;
        if p.rate > p.inflow {
            due = t + q / (p.rate - p.inflow);
        }
        if p.rate > 0.0 {
            if let Some(m) = p.marks.peek() {
                due = due.min(t + (m.pos - p.sent).max(0.0) / p.rate);
            }
        }
        if p.inflow > p.rate && p.k < p.conns {
            due = due.min(t + ((p.k as f64) * p.chunk + 2.0 * EPS_BYTES - q).max(EPS_BYTES) / (p.inflow - p.rate));
        }
        if due <= t {
            due = next_after(t);
        }
        p.due = due;
        if due < f64::INFINITY {
            let arg = PyTuple::new(py, [s as u64, p.gen as u64, p.version])?.into_any().unbind();
            self.at(py, due, arg)?;
        }
        Ok(())
    }

    fn rebalance(&mut self, py: Python<'_>, t: f64, touched: &[usize], force: bool) -> PyResult<()> {
        if !force {
            let busy = touched.iter().any(|&li| {
                let lk = &self.links[li];
                lk.greedy != 0 || lk.lim_sum > lk.capacity * (1.0 + 1e-9)
            });
            if !busy {
                return Ok(());
            }
        }
        self.rebalances += 1;
        if self.greedy.is_empty() {
            let over = touched.iter().any(|&li| {
                let lk = &self.links[li];
                lk.lim_sum > lk.capacity * (1.0 + 1e-9)
            });
            if !over {
                return Ok(());
            }
        }
        let mut check: Vec<usize> = touched.to_vec();
        let mut rates;
        loop {
            let levels;
            (rates, levels) = self.fill();
            let mut moved = false;
            let pairs: Vec<(usize, f64)> = levels.iter().copied().chain(check.iter().map(|&li| (li, -1.0))).collect();
            for (li, level) in pairs {
                {
                    let lk = &self.links[li];
                    if level < 0.0 && lk.lim_sum <= lk.capacity * (1.0 + 1e-9) {
                        continue;
                    }
                }
                while let Some(top) = self.top_limited(li) {
                    let over = {
                        let lk = &self.links[li];
                        lk.lim_sum > lk.capacity * (1.0 + 1e-9)
                    };
                    let inflow = self.paths[top as usize].inflow;
                    if !over && (level < 0.0 || inflow <= level * (1.0 + 1e-9)) {
                        break;
                    }
                    self.paths[top as usize].advance(t)?;
                    self.set_rate(top, t, 0.0);
                    self.make_greedy(top);
                    moved = true;
                    if !over {
                        break;
                    }
                }
            }
            if !moved {
                break;
            }
            check.clear();
        }
        for (s, r) in rates {
            self.paths[s as usize].advance(t)?;
            self.set_rate(s, t, r);
            self.schedule(py, s, t)?;
        }
        Ok(())
    }

    /// Weighted progressive filling (`Network._fill`): the greedy paths' rates in the order of
    /// `greedy`, and the level of each saturated link in the order found.
    fn fill(&self) -> Fill {
        let mut rates: Vec<(u32, f64)> = Vec::new();
        let mut levels: Vec<(usize, f64)> = Vec::new();
        if self.greedy.len() == 1 {
            let s = self.greedy[0];
            let one = &self.paths[s as usize];
            let mut tight = one.links[0];
            let mut room = self.links[tight].capacity - self.links[tight].lim_sum;
            for &li in &one.links[1..] {
                let r = self.links[li].capacity - self.links[li].lim_sum;
                if r < room {
                    tight = li;
                    room = r;
                }
            }
            let room = room.max(0.0) / one.k as f64;
            if one.conn_rate < room {
                rates.push((s, one.k as f64 * one.conn_rate));
            } else {
                rates.push((s, one.k as f64 * room));
                levels.push((tight, room));
            }
            return (rates, levels);
        }
        // Per link met (in order): residual, weight sum, paths on it.
        let mut order: Vec<usize> = Vec::new();
        let mut at: FxHashMap<usize, usize> = FxHashMap::default();
        let mut res: Vec<f64> = Vec::new();
        let mut wsum: Vec<f64> = Vec::new();
        let mut on: Vec<Vec<u32>> = Vec::new();
        for &s in &self.greedy {
            let p = &self.paths[s as usize];
            for &li in &p.links {
                let i = *at.entry(li).or_insert_with(|| {
                    order.push(li);
                    res.push((self.links[li].capacity - self.links[li].lim_sum).max(0.0));
                    wsum.push(0.0);
                    on.push(Vec::new());
                    order.len() - 1
                });
                wsum[i] += p.k as f64;
                on[i].push(s);
            }
        }
        let mut left: Vec<u32> = self.greedy.clone();
        let mut set_levels: FxHashMap<usize, usize> = FxHashMap::default();
        while !left.is_empty() {
            let mut lvl = f64::INFINITY;
            let mut bl: Option<usize> = None;
            let mut bf: Option<u32> = None;
            for i in 0..order.len() {
                if wsum[i] > 0.5 {
                    let x = res[i] / wsum[i];
                    if x < lvl {
                        lvl = x;
                        bl = Some(i);
                    }
                }
            }
            for &s in &left {
                let x = self.paths[s as usize].conn_rate;
                if x < lvl {
                    lvl = x;
                    bl = None;
                    bf = Some(s);
                }
            }
            let freeze: Vec<u32> = if let Some(s) = bf {
                vec![s]
            } else if let Some(i) = bl {
                let li = order[i];
                match set_levels.get(&li) {
                    Some(&j) => levels[j].1 = lvl,
                    None => {
                        set_levels.insert(li, levels.len());
                        levels.push((li, lvl));
                    }
                }
                on[i].iter().copied().filter(|s| left.contains(s)).collect()
            } else {
                left.clone()
            };
            for s in freeze {
                let p = &self.paths[s as usize];
                let mut r = if lvl < f64::INFINITY { p.k as f64 * lvl } else { f64::INFINITY };
                if r == f64::INFINITY {
                    r = if p.links.is_empty() {
                        0.0
                    } else {
                        p.links.iter().map(|&li| self.links[li].capacity).fold(f64::INFINITY, f64::min)
                    };
                }
                rates.push((s, r.max(0.0)));
                if let Some(i) = left.iter().position(|&x| x == s) {
                    left.remove(i);
                }
                for &li in &p.links {
                    let i = at[&li];
                    res[i] = (res[i] - r).max(0.0);
                    wsum[i] -= p.k as f64;
                }
            }
        }
        (rates, levels)
    }

    // -- the operations, after which the caller runs what `fired` holds ----------------------

    fn do_stream(&mut self, py: Python<'_>, s: u32, t: f64, rate: f64) -> PyResult<()> {
        self.paths[s as usize].advance(t)?;
        if self.paths[s as usize].state == GREEDY {
            self.paths[s as usize].inflow = rate;
            return self.schedule(py, s, t);
        }
        let links = self.paths[s as usize].links.clone();
        let old = self.paths[s as usize].inflow;
        if self.paths[s as usize].state == LIMITED {
            for &li in &links {
                self.remove_limited(li, s);
            }
            self.paths[s as usize].state = IDLE;
        }
        self.paths[s as usize].inflow = rate;
        if rate <= 0.0 {
            self.set_rate(s, t, 0.0);
            self.forget_if_idle(s);
        } else if rate > self.paths[s as usize].conn_rate {
            self.set_rate(s, t, 0.0);
            self.make_greedy(s);
            return self.rebalance(py, t, &links, true);
        } else {
            self.paths[s as usize].state = LIMITED;
            self.tokens += 1;
            self.paths[s as usize].token = self.tokens;
            for &li in &links {
                self.add_limited(li, s);
            }
            self.set_rate(s, t, rate);
        }
        if old != rate {
            self.rebalance(py, t, &links, false)?;
        }
        Ok(())
    }

    fn do_push(&mut self, py: Python<'_>, s: u32, t: f64, nbytes: f64, fired: &mut Fired) -> PyResult<()> {
        self.paths[s as usize].advance(t)?;
        let links = self.paths[s as usize].links.clone();
        let p = &mut self.paths[s as usize];
        p.released += nbytes;
        if nbytes <= EPS_BYTES && p.state != GREEDY {
            p.sent = p.released;
            self.fire_marks(s, fired);
            return Ok(());
        }
        if p.state == GREEDY {
            let k = self.k_of(s);
            if k != self.paths[s as usize].k {
                self.paths[s as usize].k = k;
                return self.rebalance(py, t, &links, true);
            }
            return self.schedule(py, s, t);
        }
        self.make_greedy(s);
        self.rebalance(py, t, &links, true)
    }

    fn do_end_stream(&mut self, py: Python<'_>, s: u32, t: f64, nbytes: f64, fired: &mut Fired) -> PyResult<()> {
        self.paths[s as usize].advance(t)?;
        if self.paths[s as usize].state == GREEDY {
            self.paths[s as usize].inflow = 0.0;
            return self.do_push(py, s, t, nbytes, fired);
        }
        let links = self.paths[s as usize].links.clone();
        if self.paths[s as usize].state == LIMITED {
            for &li in &links {
                self.remove_limited(li, s);
            }
            self.set_rate(s, t, 0.0);
        }
        let p = &mut self.paths[s as usize];
        p.inflow = 0.0;
        p.state = IDLE;
        if nbytes <= EPS_BYTES {
            p.released += nbytes;
            p.sent = p.released;
            self.fire_marks(s, fired);
            self.forget_if_idle(s);
            return self.rebalance(py, t, &links, false);
        }
        p.released += nbytes;
        self.make_greedy(s);
        self.rebalance(py, t, &links, true)
    }

    fn do_due(&mut self, py: Python<'_>, s: u32, version: u64, fired: &mut Fired) -> PyResult<()> {
        {
            let p = &self.paths[s as usize];
            if version != p.version || p.state != GREEDY {
                return Ok(());
            }
        }
        let t = self.now(py)?;
        let links = self.paths[s as usize].links.clone();
        let p = &mut self.paths[s as usize];
        p.due = f64::INFINITY;
        p.advance(t)?;
        let q = p.released - p.sent;
        if q <= EPS_BYTES {
            p.sent = p.released;
            self.fire_marks(s, fired);
            self.leave_greedy(s, t);
            return self.rebalance(py, t, &links, true);
        }
        self.fire_marks(s, fired);
        let k = self.k_of(s);
        if k > self.paths[s as usize].k {
            self.paths[s as usize].k = k;
            return self.rebalance(py, t, &links, true);
        }
        self.schedule(py, s, t)
    }

    fn do_withdraw(&mut self, py: Python<'_>, s: u32, lo: f64, hi: f64, fired: &mut Fired) -> PyResult<()> {
        let t = self.now(py)?;
        self.paths[s as usize].advance(t)?;
        let links = self.paths[s as usize].links.clone();
        let p = &mut self.paths[s as usize];
        let lo = if p.sent > lo { p.sent } else { lo };
        let hi = if p.released < hi { p.released } else { hi };
        if hi <= lo {
            return Ok(());
        }
        let gone = hi - lo;
        p.released -= gone;
        if !p.marks.is_empty() {
            let old = std::mem::take(&mut p.marks);
            p.marks = old
                .into_iter()
                .map(|mk| {
                    let pos = if mk.pos <= lo {
                        mk.pos
                    } else if mk.pos > hi {
                        mk.pos - gone
                    } else {
                        lo
                    };
                    Mark { pos, ..mk }
                })
                .collect();
        }
        if p.state == GREEDY {
            if p.released - p.sent <= EPS_BYTES && p.inflow == 0.0 {
                p.sent = p.released;
                self.fire_marks(s, fired);
                self.leave_greedy(s, t);
                return self.rebalance(py, t, &links, true);
            }
            return self.schedule(py, s, t);
        }
        self.fire_marks(s, fired);
        Ok(())
    }
}

fn next_after(t: f64) -> f64 {
    // math.nextafter(t, inf) for finite t.
    if t.is_nan() || t == f64::INFINITY {
        return t;
    }
    if t == 0.0 {
        return f64::from_bits(1);
    }
    let b = t.to_bits();
    f64::from_bits(if t > 0.0 { b + 1 } else { b - 1 })
}

fn run_fired(py: Python<'_>, fired: Fired, t: f64) -> PyResult<()> {
    for (f, arg) in fired {
        f.call1(py, (arg, t))?;
    }
    Ok(())
}

#[pymethods]
impl FlowNet {
    /// `nodes`: the node ids; `node_dc`: each node's datacenter (an index); `links`: (capacity, counter) of every link;
    /// `nic_out`, `nic_in`: each node's NIC links; `wan`: {(dc, dc): link}; `counters`: how many
    /// (every link's, then each node's sent and received: `sent_of`, `received_of`); `route`:
    /// {(dc, dc): (delay, per-connection rate)}; `conns`, `chunk`: the transfer's.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        loop_: Py<PyAny>,
        net_priority: i64,
        nodes: Vec<String>,
        node_dc: Vec<usize>,
        links: Vec<(f64, usize)>,
        nic_out: Vec<usize>,
        nic_in: Vec<usize>,
        wan: FxHashMap<(usize, usize), usize>,
        counters: usize,
        sent_of: Vec<usize>,
        received_of: Vec<usize>,
        route: FxHashMap<(usize, usize), (f64, f64)>,
        conns: i64,
        chunk: f64,
    ) -> PyResult<Self> {
        let n = node_dc.len();
        if nodes.len() != n || nic_out.len() != n || nic_in.len() != n || sent_of.len() != n || received_of.len() != n {
            return Err(PyValueError::new_err("FlowNet: one NIC and counter per node"));
        }
        let native_loop = loop_.bind(py).cast::<EventLoop>().ok().map(|l| l.clone().unbind());
        Ok(FlowNet {
            loop_,
            native_loop,
            net_priority,
            due_cb: None,
            chunk,
            conns,
            node_dc,
            node_index: nodes.into_iter().enumerate().map(|(i, id)| (id, i)).collect(),
            links: links
                .into_iter()
                .map(|(capacity, counter)| Link {
                    capacity,
                    counter,
                    lim_sum: 0.0,
                    limited: 0,
                    heap: BinaryHeap::new(),
                    greedy: 0,
                })
                .collect(),
            counters: vec![Counter::default(); counters],
            nic_out,
            nic_in,
            wan,
            sent_of,
            received_of,
            route,
            by_pair: FxHashMap::default(),
            paths: Vec::new(),
            handles: Vec::new(),
            forgotten: Vec::new(),
            greedy: Vec::new(),
            greedy_of: vec![Vec::new(); n],
            tokens: 0,
            seq: 0,
            rebalances: 0,
        })
    }

    /// Give the network the callable its events call (`self._due`, taken once).
    fn bind(slf: &Bound<'_, Self>) -> PyResult<()> {
        let cb = slf.getattr("_due")?.unbind();
        slf.borrow_mut().due_cb = Some(cb);
        Ok(())
    }

    /// The path from node `src` to node `dst`, made (or made again) when needed.
    fn path(&mut self, py: Python<'_>, src: &str, dst: &str) -> PyResult<Py<NetPath>> {
        let (src, dst) = (self.node(src)?, self.node(dst)?);
        if let Some(&s) = self.by_pair.get(&(src, dst)) {
            return Ok(self.handle(py, s));
        }
        let (a, b) = (self.node_dc[src], self.node_dc[dst]);
        let links = if a != b {
            let w = *self.wan.get(&(a, b)).ok_or_else(|| PyValueError::new_err("FlowNet: no WAN link"))?;
            vec![self.nic_out[src], w, self.nic_in[dst]]
        } else {
            vec![self.nic_out[src], self.nic_in[dst]]
        };
        let mut counters: Vec<usize> = links.iter().map(|&li| self.links[li].counter).collect();
        counters.push(self.sent_of[src]);
        counters.push(self.received_of[dst]);
        let (delay, conn_rate) = *self.route.get(&(a, b)).ok_or_else(|| PyValueError::new_err("FlowNet: no route"))?;
        let t = self.now(py)?;
        let fresh = Path {
            gen: 0,
            live: true,
            src,
            dst,
            links,
            counters,
            conns: self.conns,
            chunk: self.chunk,
            conn_rate,
            released: 0.0,
            sent: 0.0,
            t,
            inflow: 0.0,
            rate: 0.0,
            state: IDLE,
            k: 1,
            marks: BinaryHeap::new(),
            version: 0,
            token: 0,
            due: f64::INFINITY,
        };
        let s = match self.free_slot(py) {
            Some(s) => {
                // Events still due for the slot's old path carry its generation: they find a
                // new one and are dropped.
                let gen = self.paths[s as usize].gen.wrapping_add(1);
                self.paths[s as usize] = Path { gen, ..fresh };
                self.handles[s as usize] = Py::new(py, NetPath { slot: s, gen, delay })?;
                s
            }
            None => {
                let s = self.paths.len() as u32;
                self.paths.push(fresh);
                self.handles.push(Py::new(py, NetPath { slot: s, gen: 0, delay })?);
                s
            }
        };
        self.by_pair.insert((src, dst), s);
        Ok(self.handle(py, s))
    }

    fn stream(&mut self, py: Python<'_>, p: &NetPath, t: f64, rate: f64) -> PyResult<()> {
        let s = self.slot(p)?;
        self.do_stream(py, s, t, rate)
    }

    fn push(slf: &Bound<'_, Self>, p: &NetPath, t: f64, nbytes: f64) -> PyResult<()> {
        let py = slf.py();
        let mut fired = Vec::new();
        {
            let mut me = slf.borrow_mut();
            let s = me.slot(p)?;
            me.do_push(py, s, t, nbytes, &mut fired)?;
        }
        run_fired(py, fired, t)
    }

    fn end_stream(slf: &Bound<'_, Self>, p: &NetPath, t: f64, nbytes: f64) -> PyResult<()> {
        let py = slf.py();
        let mut fired = Vec::new();
        {
            let mut me = slf.borrow_mut();
            let s = me.slot(p)?;
            me.do_end_stream(py, s, t, nbytes, &mut fired)?;
        }
        run_fired(py, fired, t)
    }

    /// Call `fn(arg, t)` at the time t the path's sender has sent `pos` bytes (cumulative).
    #[pyo3(signature = (p, pos, r#fn, arg))]
    fn mark(slf: &Bound<'_, Self>, p: &NetPath, pos: f64, r#fn: Py<PyAny>, arg: Py<PyAny>) -> PyResult<()> {
        let py = slf.py();
        let t;
        {
            let mut me = slf.borrow_mut();
            let s = me.slot(p)?;
            t = me.now(py)?;
            me.paths[s as usize].advance(t)?;
            if pos > me.paths[s as usize].sent + EPS_BYTES {
                me.seq += 1;
                let seq = me.seq;
                let path = &mut me.paths[s as usize];
                path.marks.push(Mark { pos, seq, fn_: r#fn, arg });
                if path.state == GREEDY && path.rate > 0.0 && t + (pos - path.sent) / path.rate < path.due {
                    me.schedule(py, s, t)?;
                }
                return Ok(());
            }
        }
        r#fn.call1(py, (arg, t))?;
        Ok(())
    }

    /// Cumulative bytes that entered the path (now): the position a new byte gets.
    fn position(&mut self, py: Python<'_>, p: &NetPath) -> PyResult<f64> {
        let s = self.slot(p)?;
        let t = self.now(py)?;
        self.paths[s as usize].advance(t)?;
        Ok(self.paths[s as usize].released)
    }

    fn withdraw(slf: &Bound<'_, Self>, p: &NetPath, lo: f64, hi: f64) -> PyResult<()> {
        let py = slf.py();
        let mut fired = Vec::new();
        let t;
        {
            let mut me = slf.borrow_mut();
            let s = me.slot(p)?;
            t = me.now(py)?;
            me.do_withdraw(py, s, lo, hi, &mut fired)?;
        }
        run_fired(py, fired, t)
    }

    /// A path's event: (slot, generation, version).
    fn _due(slf: &Bound<'_, Self>, arg: (u32, u32, u64)) -> PyResult<()> {
        let py = slf.py();
        let (s, gen, version) = arg;
        let mut fired = Vec::new();
        let t;
        {
            let mut me = slf.borrow_mut();
            if me.paths[s as usize].gen != gen {
                return Ok(());
            }
            t = me.now(py)?;
            me.do_due(py, s, version, &mut fired)?;
        }
        run_fired(py, fired, t)
    }

    /// Bytes the node's sender has put on the wire by `t`, and its rate now.
    fn sent_at(&self, node: &str, t: f64) -> PyResult<f64> {
        let node = self.node(node)?;
        Ok(self.counters[self.sent_of[node]].at(t))
    }

    fn sent_rate(&self, node: &str) -> PyResult<f64> {
        Ok(self.counters[self.sent_of[self.node(node)?]].rate)
    }

    fn received_at(&self, node: &str, t: f64) -> PyResult<f64> {
        let node = self.node(node)?;
        Ok(self.counters[self.received_of[node]].at(t))
    }

    fn link_bytes(&self, link: usize, t: f64) -> f64 {
        self.counters[self.links[link].counter].at(t)
    }

    /// Bytes queued at `t` on the node's greedy paths (in the order they became greedy).
    fn backlog(&self, node: &str, t: f64) -> PyResult<f64> {
        let node = self.node(node)?;
        let mut total = 0.0;
        for &s in &self.greedy_of[node] {
            total += self.paths[s as usize].queued(t);
        }
        Ok(total)
    }
}
