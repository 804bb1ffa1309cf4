//! `mooncake_rows`: the values of Mooncake JSONL lines (`testbed.traces.mooncake.iter_mooncake`)
//! for a block of whole lines, where a line is plainly a good row. Only one shape is taken: one
//! JSON object (JSON whitespace around it and between its tokens) whose keys are `timestamp`,
//! `input_length`, `output_length` and `hash_ids`, and any of the session keys `chat_id`,
//! `parent_chat_id` and `think_time`, once each in any order, written without escapes; the token
//! counts and hash ids unsigned JSON integers within the limits the caller passes, the timestamp
//! an unsigned JSON number within its limit. A session key's value is taken only in a form the
//! Python checks pass and read the same: the chat ids a JSON integer within i64 (never past it,
//! where Python's ints go on) or a string without escapes or control characters, valid UTF-8;
//! `parent_chat_id` also null; `think_time` an unsigned JSON number or null, finite. Any other
//! line (another key, a value out of range or of another type, a byte outside a string that is
//! not ASCII, text the JSON reader would refuse) is handed back as its bytes, and the caller reads
//! it the Python way, which words every error.
//!
//! Lines end after each b"\n", as a binary file's lines do; so within a line a b"\n" can only be
//! its end, and the scan, never stepping over one, stays in its line.
//!
//! A timestamp written with a fraction or an exponent is a float, read correctly rounded as
//! CPython's `float()` reads it (Rust's parse is correctly rounded too); one without is an int,
//! as Python's `json` gives them.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyFloat, PyList, PyString, PyTuple};

/// A number text longer than this goes the Python way (no trace writes one; it spares any
/// question of how either reader treats an extreme exponent).
const MAX_NUMBER_LEN: usize = 64;

struct Limits {
    max_ts: u64,
    /// `max_ts` as a float where it is one exactly (else float timestamps go the Python way).
    max_ts_float: Option<f64>,
    min_tokens: u64,
    max_input: u64,
    max_output: u64,
    max_hash: u64,
}

impl Limits {
    fn new(max_ts: u64, min_tokens: u64, max_input: u64, max_output: u64, max_hash: u64) -> Self {
        let max_ts_float = max_ts as f64;
        Limits {
            max_ts,
            max_ts_float: (max_ts_float < u64::MAX as f64 && max_ts_float as u64 == max_ts).then_some(max_ts_float),
            min_tokens,
            max_input,
            max_output,
            max_hash,
        }
    }
}

#[derive(Clone, Copy)]
enum Stamp {
    Int(u64),
    Float(f64),
}

/// A chat id as json reads it: an int or a str.
enum Chat<'a> {
    Int(i64),
    Str(&'a str),
}

/// A line's session keys: `chat_id` (None: absent; without it Python reads neither of the
/// others), `parent_chat_id` as Python's `obj.get("parent_chat_id", -1)` (None: null),
/// `think_time` as `float()` of it (None: null or absent).
struct Session<'a> {
    chat: Option<Chat<'a>>,
    parent: Option<Chat<'a>>,
    think: Option<f64>,
}

impl Session<'_> {
    const ABSENT: Self = Session { chat: None, parent: Some(Chat::Int(-1)), think: None };
}

/// The keys a line may have, by their bit in `Scan::row`'s `seen`.
const TIMESTAMP: usize = 0;
const INPUT_LENGTH: usize = 1;
const OUTPUT_LENGTH: usize = 2;
const HASH_IDS: usize = 3;
const CHAT_ID: usize = 4;
const PARENT_CHAT_ID: usize = 5;
const THINK_TIME: usize = 6;
/// The keys every row has.
const ROW_KEYS: u8 = 0b1111;

struct Scan<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    /// JSON whitespace but the line's end.
    fn space(&mut self) {
        while let Some(b' ' | b'\t' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        let found = self.s.get(self.i) == Some(&c);
        self.i += found as usize;
        found
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        self.i - start
    }

    /// An unsigned JSON integer (`0` or `[1-9][0-9]*`); None where none starts or past 19 digits
    /// (what u64 always holds; 2^63 - 1, the largest limit, has 19). A leading zero followed by
    /// digits ends at the zero, and the delimiter check after refuses it.
    fn int(&mut self) -> Option<u64> {
        let rest = &self.s[self.i..];
        let first = rest.first()?.wrapping_sub(b'0');
        if first > 9 {
            return None;
        }
        if first == 0 {
            self.i += 1;
            return Some(0);
        }
        let mut n = u64::from(first);
        let mut len = 1;
        for &c in &rest[1..] {
            let d = c.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            n = n.wrapping_mul(10).wrapping_add(u64::from(d));
            len += 1;
        }
        self.i += len;
        (len <= 19).then_some(n)
    }

    /// The token count or hash id at the cursor, if within `lo..=hi`.
    fn int_in(&mut self, lo: u64, hi: u64) -> Option<u64> {
        self.int().filter(|n| (lo..=hi).contains(n))
    }

    /// An unsigned JSON number: an int, or with a fraction or an exponent a float (JSON's
    /// grammar: `.` then digits, `e`/`E`, an optional sign, then digits); an int up to `max_int`,
    /// a float up to `max_float` (None: none). Inlined in each use: the timestamp's is on every line.
    #[inline(always)]
    fn number(&mut self, max_int: u64, max_float: Option<f64>) -> Option<Stamp> {
        let start = self.i;
        let n = self.int()?;
        let mut float = false;
        if self.s.get(self.i) == Some(&b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return None;
            }
            float = true;
        }
        if let Some(b'e' | b'E') = self.s.get(self.i) {
            self.i += 1;
            if let Some(b'+' | b'-') = self.s.get(self.i) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return None;
            }
            float = true;
        }
        if !float {
            return (n <= max_int).then_some(Stamp::Int(n));
        }
        if self.i - start > MAX_NUMBER_LEN {
            return None;
        }
        // ASCII digits, a point, an exponent: both the text and the parse succeed.
        let x: f64 = std::str::from_utf8(&self.s[start..self.i]).ok()?.parse().ok()?;
        (x <= max_float?).then_some(Stamp::Float(x))
    }

    fn stamp(&mut self, lim: &Limits) -> Option<Stamp> {
        self.number(lim.max_ts, lim.max_ts_float)
    }

    /// `think_time` as `float()` makes it: a finite float (an int past 19 digits, or a float text
    /// that rounds to infinity, the Python way).
    fn think(&mut self) -> Option<f64> {
        match self.number(u64::MAX, Some(f64::MAX))? {
            // Rounded to nearest, ties to even, as CPython's int-to-float conversion rounds.
            Stamp::Int(n) => Some(n as f64),
            Stamp::Float(x) => Some(x),
        }
    }

    fn null(&mut self) -> bool {
        let found = self.s[self.i..].starts_with(b"null");
        self.i += 4 * found as usize;
        found
    }

    /// A chat id: a JSON integer within i64 (`-0` is 0, as `int()` reads it), or a string of
    /// plain characters (no escape, no control character: JSON refuses those unescaped), valid
    /// UTF-8 as the line's decoding needs.
    fn chat(&mut self) -> Option<Chat<'a>> {
        let s = self.s;
        if s.get(self.i) == Some(&b'"') {
            let start = self.i + 1;
            let len = s[start..].iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20)?;
            if s[start + len] != b'"' {
                return None;
            }
            self.i = start + len + 1;
            return std::str::from_utf8(&s[start..start + len]).ok().map(Chat::Str);
        }
        let minus = self.eat(b'-');
        let n = i64::try_from(self.int()?).ok()?;
        Some(Chat::Int(if minus { -n } else { n }))
    }

    /// The value of session key `k` into `session`. Apart, as `hash_ids` is, so that the scan of a
    /// plain row keeps its registers (all inlined, it took some 4% more instructions than before
    /// sessions were read).
    #[inline(never)]
    fn session_value(&mut self, k: usize, session: &mut Session<'a>) -> Option<()> {
        match k {
            CHAT_ID => session.chat = Some(self.chat()?),
            PARENT_CHAT_ID => session.parent = if self.null() { None } else { Some(self.chat()?) },
            _ => session.think = if self.null() { None } else { Some(self.think()?) },
        }
        Some(())
    }

    /// Which key the string at the cursor is (one with an escape is none of them).
    fn key(&mut self) -> Option<usize> {
        let rest = &self.s[self.i..];
        let (k, text): (usize, &[u8]) = match rest.get(1)? {
            b't' if rest.get(2) == Some(&b'h') => (THINK_TIME, b"\"think_time\""),
            b't' => (TIMESTAMP, b"\"timestamp\""),
            b'i' => (INPUT_LENGTH, b"\"input_length\""),
            b'o' => (OUTPUT_LENGTH, b"\"output_length\""),
            b'h' => (HASH_IDS, b"\"hash_ids\""),
            b'c' => (CHAT_ID, b"\"chat_id\""),
            b'p' => (PARENT_CHAT_ID, b"\"parent_chat_id\""),
            _ => return None,
        };
        if !rest.starts_with(text) {
            return None;
        }
        self.i += text.len();
        Some(k)
    }

    /// The hash ids at the cursor into `ids`. Apart, on a copy of the scan, so that the loop (the
    /// most of a row's scan) keeps its cursor and the number it reads in registers.
    #[inline(never)]
    fn hash_ids(&mut self, lim: &Limits, ids: &mut Vec<u64>) -> Option<()> {
        let mut scan = Scan { s: self.s, i: self.i };
        let found = scan.hash_list(lim.max_hash, ids);
        self.i = scan.i;
        found
    }

    fn hash_list(&mut self, max_hash: u64, ids: &mut Vec<u64>) -> Option<()> {
        if !self.eat(b'[') {
            return None;
        }
        self.space();
        if self.eat(b']') {
            return Some(());
        }
        loop {
            ids.push(self.int_in(0, max_hash)?);
            self.space();
            match self.s.get(self.i) {
                Some(b']') => {
                    self.i += 1;
                    return Some(());
                }
                Some(b',') => self.i += 1,
                _ => return None,
            }
            self.space();
        }
    }

    /// The row of the line at the cursor, its hash ids left in `ids` and its session keys in
    /// `session` (as it was where the line has none), the cursor then past the line; None: the
    /// Python way, the cursor not past the line's end.
    fn row(&mut self, lim: &Limits, ids: &mut Vec<u64>, session: &mut Session<'a>) -> Option<(Stamp, u64, u64)> {
        self.space();
        if !self.eat(b'{') {
            return None;
        }
        let (mut ts, mut inp, mut out) = (None, None, None);
        let mut seen = 0u8;
        loop {
            self.space();
            let k = self.key()?;
            if seen & (1 << k) != 0 {
                return None; // a repeated key: the last one counts in Python
            }
            seen |= 1 << k;
            self.space();
            if !self.eat(b':') {
                return None;
            }
            self.space();
            match k {
                TIMESTAMP => ts = Some(self.stamp(lim)?),
                INPUT_LENGTH => inp = Some(self.int_in(lim.min_tokens, lim.max_input)?),
                OUTPUT_LENGTH => out = Some(self.int_in(lim.min_tokens, lim.max_output)?),
                HASH_IDS => self.hash_ids(lim, ids)?,
                _ => self.session_value(k, session)?,
            }
            self.space();
            if self.eat(b'}') {
                break;
            }
            if !self.eat(b',') {
                return None;
            }
        }
        self.space();
        if seen & ROW_KEYS != ROW_KEYS || !(self.i == self.s.len() || self.eat(b'\n')) {
            return None;
        }
        Some((ts?, inp?, out?))
    }
}

/// `t` left out of the cycle collector, as CPython's collector itself leaves a tuple of ints and
/// floats once it meets one: a batch's tuples would otherwise be traversed by every collection
/// they live through, a third of the time this takes. A session row's list too, which the
/// collector never leaves by itself.
fn untracked<T>(t: Bound<'_, T>) -> Bound<'_, T> {
    // SAFETY: `t` is a live tuple or list, tracked since its creation, no one else's yet; it
    // holds only ints, floats, strs, None and such tuples, which can be in no reference cycle,
    // and the caller only unpacks it (never puts anything in).
    unsafe { pyo3::ffi::PyObject_GC_UnTrack(t.as_ptr().cast()) };
    t
}

fn chat_object<'py>(py: Python<'py>, chat: Option<Chat<'_>>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match chat {
        None => py.None().into_bound(py),
        Some(Chat::Int(n)) => n.into_pyobject(py)?.into_any(),
        Some(Chat::Str(s)) => PyString::new(py, s).into_any(),
    })
}

/// A session row's list: `row`'s values, then the session's.
#[inline(never)]
fn session_row<'py>(py: Python<'py>, row: [Bound<'py, PyAny>; 4], session: Session<'_>) -> PyResult<Bound<'py, PyAny>> {
    let think = match session.think {
        None => py.None().into_bound(py),
        Some(x) => PyFloat::new(py, x).into_any(),
    };
    let [ts, inp, out, ids] = row;
    let row = [ts, inp, out, ids, chat_object(py, session.chat)?, chat_object(py, session.parent)?, think];
    Ok(untracked(PyList::new(py, row)?).into_any())
}

/// The row starting at `start` of `s` (`Scan::row`, its hash ids into `ids`), its session keys,
/// and where the scan stopped: past the row's line where it is a row.
fn row_at<'a>(
    s: &'a [u8],
    start: usize,
    lim: &Limits,
    ids: &mut Vec<u64>,
) -> (Option<(Stamp, u64, u64)>, Session<'a>, usize) {
    ids.clear();
    let mut session = Session::ABSENT;
    let mut scan = Scan { s, i: start };
    let row = scan.row(lim, ids, &mut session);
    (row, session, scan.i)
}

/// Per line of `block` (whole lines, each but the last ending in b"\n"), `(timestamp,
/// input_length, output_length, hash_ids tuple)` where it is a good row of the one shape this
/// reads, `[timestamp, input_length, output_length, hash_ids tuple, chat_id, parent_chat_id,
/// think_time]` where it is one with `chat_id` (a list: the caller tells the two apart by type
/// alone, sparing the plain rows a length check), else the line's bytes.
#[pyfunction]
pub fn mooncake_rows<'py>(
    py: Python<'py>,
    block: &Bound<'py, PyBytes>,
    max_timestamp: u64,
    min_tokens: u64,
    max_input: u64,
    max_output: u64,
    max_hash: u64,
) -> PyResult<Bound<'py, PyList>> {
    let lim = Limits::new(max_timestamp, min_tokens, max_input, max_output, max_hash);
    let s = block.as_bytes();
    let mut ids = Vec::new();
    let mut rows = Vec::new();
    let mut start = 0;
    while start < s.len() {
        let (row, session, at) = row_at(s, start, &lim, &mut ids);
        let row = match row {
            None => {
                let end = s[at..].iter().position(|&c| c == b'\n').map_or(s.len(), |k| at + k + 1);
                let line = PyBytes::new(py, &s[start..end]).into_any();
                start = end;
                line
            }
            Some((ts, inp, out)) => {
                start = at;
                let ts = stamp_object(py, ts)?;
                let ids = untracked(PyTuple::new(py, &ids)?);
                match session.chat {
                    None => untracked((ts, inp, out, ids).into_pyobject(py)?).into_any(),
                    Some(_) => session_row(
                        py,
                        [ts, inp.into_pyobject(py)?.into_any(), out.into_pyobject(py)?.into_any(), ids.into_any()],
                        session,
                    )?,
                }
            }
        };
        rows.push(row);
    }
    PyList::new(py, rows)
}

/// A timestamp as Python compares it with another: exactly, as both are within 2^53 (the caller's
/// limit), where an int is a float exactly.
fn stamp_value(t: Stamp) -> f64 {
    match t {
        Stamp::Int(n) => n as f64,
        Stamp::Float(x) => x,
    }
}

fn stamp_object(py: Python<'_>, t: Stamp) -> PyResult<Bound<'_, PyAny>> {
    Ok(match t {
        Stamp::Int(n) => n.into_pyobject(py)?.into_any(),
        Stamp::Float(x) => PyFloat::new(py, x).into_any(),
    })
}

/// A block's rows and its first and last timestamps, as Python objects.
type Counted<'py> = (usize, Bound<'py, PyAny>, Bound<'py, PyAny>);

/// What a first pass over a trace needs of `block` (whole lines, as `mooncake_rows` takes them)
/// where every line is a row `mooncake_rows` reads as a plain one (no `chat_id`) and their
/// timestamps never go back: `(rows, first timestamp, last timestamp)`, the timestamps the
/// objects `mooncake_rows` gives. None for any other block, an empty one too: the caller reads it
/// line by line, which words what is wrong. No row's values become objects, which is where
/// `mooncake_rows` spends most of its time.
#[pyfunction]
pub fn mooncake_scan<'py>(
    py: Python<'py>,
    block: &Bound<'py, PyBytes>,
    max_timestamp: u64,
    min_tokens: u64,
    max_input: u64,
    max_output: u64,
    max_hash: u64,
) -> PyResult<Option<Counted<'py>>> {
    let lim = Limits::new(max_timestamp, min_tokens, max_input, max_output, max_hash);
    let s = block.as_bytes();
    let mut ids = Vec::new();
    let mut start = 0;
    let mut rows = 0usize;
    let (mut first, mut last): (Option<Stamp>, Option<Stamp>) = (None, None);
    while start < s.len() {
        let (Some((ts, _, _)), session, at) = row_at(s, start, &lim, &mut ids) else {
            return Ok(None);
        };
        if session.chat.is_some() || last.is_some_and(|p| stamp_value(ts) < stamp_value(p)) {
            return Ok(None);
        }
        start = at;
        rows += 1;
        first.get_or_insert(ts);
        last = Some(ts);
    }
    match (first, last) {
        (Some(f), Some(l)) => Ok(Some((rows, stamp_object(py, f)?, stamp_object(py, l)?))),
        _ => Ok(None),
    }
}
