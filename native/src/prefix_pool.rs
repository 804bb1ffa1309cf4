//! `PrefixPool`: `testbed.core.routing.prefix_cache.HybridPrefixCache` compiled (its module docstring
//! says what the pool keeps and how it evicts). The entries live in a slab threaded by an
//! intrusive doubly linked list in LRU order (oldest at the head), which is what the Python
//! `OrderedDict` is; a pinned entry is never evicted, so the slots an owner pins stay its own
//! until it unpins them.

use pyo3::exceptions::{PyAssertionError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList, PyTuple};
use rustc_hash::FxHashMap;

const NIL: u32 = u32::MAX;
const BLOCK: u8 = 0;
const STATE: u8 = 1;

/// A hash id: the trace's integer, or (`big`) the pool's own number for an integer beyond 64
/// bits (numbered in the order the pool first stored it; only equality matters).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Hid {
    value: i64,
    big: bool,
}

/// ("b", block index, hash) or ("s", blocks, hash of the last block), as in the Python pool,
/// in 16 bytes: a long run's pool holds about a million entries, and evicting and adding them
/// is mostly waiting on the index's and the slab's memory, so the smaller the entry the better.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Key {
    value: i64,
    pos: u32,
    kind: u8,
    big: bool,
}

impl Key {
    /// None for a position no entry can have (negative, or past any prompt's blocks).
    fn new(kind: u8, pos: i64, hid: Hid) -> Option<Key> {
        let pos = u32::try_from(pos).ok()?;
        Some(Key { value: hid.value, pos, kind, big: hid.big })
    }

    /// A key of the prompt being stored (its positions are its blocks').
    fn stored(kind: u8, pos: i64, hid: Hid) -> Key {
        Key::new(kind, pos, hid).expect("a block position fits 32 bits")
    }

    /// The key's hash, laid out for the index (a `hashbrown` table: the low bits pick the bucket,
    /// the top seven are the tag its probes compare first). Traces number a new block one past
    /// the last (Mooncake's `hash_ids`, ours), and a pool inserts and evicts a prompt's blocks
    /// together: with the bucket taken from the number itself, folded so that a stride does not
    /// pile keys into one bucket, a prompt's keys share a few cache lines of a table far larger
    /// than the cache, where a mixed hash sends each to its own (a miss each, most of a long
    /// run's eviction time). The tag mixes every field, so probes still tell keys apart at once.
    fn spread(&self) -> u64 {
        let v = self.value as u64;
        let fields = u64::from(self.pos) << 16 | u64::from(self.kind) << 8 | u64::from(self.big);
        let tag =
            (v ^ fields.rotate_left(40)).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ v.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        let fold = v ^ (v >> 21) ^ (v >> 42) ^ u64::from(self.big) << 20;
        let bucket = fold << 1 | u64::from(self.kind);
        (tag & TAG_BITS) | (bucket & !TAG_BITS)
    }
}

impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.spread());
    }
}

const TAG_BITS: u64 = 0x7F << 57;

/// Hands `Key::spread` to the table as it is.
#[derive(Default, Clone, Copy)]
struct KeyHash(u64);

impl std::hash::Hasher for KeyHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, _: &[u8]) {
        unreachable!("a Key hashes as one word")
    }

    fn write_u64(&mut self, h: u64) {
        self.0 = h;
    }
}

type KeyIndex = std::collections::HashMap<Key, u32, std::hash::BuildHasherDefault<KeyHash>>;

struct Slot {
    key: Key,
    nbytes: i64,
    pins: i64,
    prev: u32,
    next: u32,
}

/// What a cluster's pool holds of a prompt (`prefix_cache.Match`).
#[pyclass(module = "testbed_native", frozen, eq, get_all)]
#[derive(PartialEq, Clone, Debug)]
pub struct PoolMatch {
    tokens: i64,
    full_tokens: i64,
}

#[pymethods]
impl PoolMatch {
    fn __repr__(&self) -> String {
        format!("Match(tokens={}, full_tokens={})", self.tokens, self.full_tokens)
    }
}

/// The pool's counters (`prefix_cache.PoolStats`), as read at one moment.
#[pyclass(module = "testbed_native", frozen, eq, get_all)]
#[derive(PartialEq, Clone, Default, Debug)]
pub struct PoolStats {
    lookups: i64,
    hit_tokens: i64,
    inserted_bytes: i64,
    evicted_bytes: i64,
    evictions: i64,
    refused_bytes: i64,
}

/// A prompt's hash ids as given (a list or tuple is read in place, anything else once).
enum Ids<'py> {
    List(Bound<'py, PyList>),
    Tuple(Bound<'py, PyTuple>),
}

impl<'py> Ids<'py> {
    fn of(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(l) = obj.cast::<PyList>() {
            return Ok(Ids::List(l.clone()));
        }
        if let Ok(t) = obj.cast::<PyTuple>() {
            return Ok(Ids::Tuple(t.clone()));
        }
        let l = PyList::empty(obj.py());
        for x in obj.try_iter()? {
            l.append(x?)?;
        }
        Ok(Ids::List(l))
    }

    fn len(&self) -> usize {
        match self {
            Ids::List(l) => l.len(),
            Ids::Tuple(t) => t.len(),
        }
    }

    fn get(&self, i: usize) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Ids::List(l) => l.get_item(i),
            Ids::Tuple(t) => t.get_item(i),
        }
    }
}

/// An entry as `entries` lists it: kind, position, hash id, bytes, pins.
type EntryView = (&'static str, i64, Py<PyAny>, i64, i64);

#[pyclass(module = "testbed_native")]
pub struct PrefixPool {
    #[pyo3(get)]
    capacity_bytes: i64,
    #[pyo3(get)]
    block_tokens: i64,
    #[pyo3(get)]
    block_bytes: i64,
    #[pyo3(get)]
    state_bytes: i64,
    #[pyo3(get)]
    used_bytes: i64,
    stats: PoolStats,
    index: KeyIndex,
    slots: Vec<Slot>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    pins: FxHashMap<String, Vec<u32>>,
    holds_: FxHashMap<String, i64>,
    pinned_entry_bytes: i64,
    held_bytes: i64,
    big: Py<PyDict>,
}

fn floor_div(a: i64, b: i64) -> i64 {
    a.div_euclid(b)
}

fn nonnegative(tokens: i64, what: &str) -> PyResult<i64> {
    if tokens < 0 {
        return Err(PyValueError::new_err(format!("{what} must be >= 0, got {tokens}")));
    }
    Ok(tokens)
}

impl PrefixPool {
    // -- the LRU list ---------------------------------------------------------------------------

    fn unlink(&mut self, s: u32) {
        let (prev, next) = {
            let slot = &self.slots[s as usize];
            (slot.prev, slot.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
    }

    fn link_last(&mut self, s: u32) {
        let tail = self.tail;
        {
            let slot = &mut self.slots[s as usize];
            slot.prev = tail;
            slot.next = NIL;
        }
        if tail == NIL {
            self.head = s;
        } else {
            self.slots[tail as usize].next = s;
        }
        self.tail = s;
    }

    fn move_to_end(&mut self, s: u32) {
        if self.tail != s {
            self.unlink(s);
            self.link_last(s);
        }
    }

    fn add(&mut self, key: Key, nbytes: i64) -> u32 {
        let slot = Slot { key, nbytes, pins: 0, prev: NIL, next: NIL };
        let s = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = slot;
                s
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(key, s);
        self.link_last(s);
        s
    }

    fn remove(&mut self, s: u32) {
        self.unlink(s);
        let key = self.slots[s as usize].key;
        self.index.remove(&key);
        self.free.push(s);
    }

    fn find(&self, kind: u8, pos: i64, hid: Option<Hid>) -> Option<u32> {
        hid.and_then(|hid| Key::new(kind, pos, hid)).and_then(|key| self.index.get(&key).copied())
    }

    // -- hash ids -------------------------------------------------------------------------------

    /// The pool's id of a hash id; `None` for an integer beyond 64 bits it never stored (so no
    /// entry can hold it), unless `store` numbers it.
    fn hid(&self, x: &Bound<'_, PyAny>, store: bool) -> PyResult<Option<Hid>> {
        if let Ok(v) = x.extract::<i64>() {
            return Ok(Some(Hid { value: v, big: false }));
        }
        if !x.is_instance_of::<PyInt>() {
            return Err(PyTypeError::new_err(format!("a hash id must be an integer, got {}", x.get_type().name()?)));
        }
        let big = self.big.bind(x.py());
        if let Some(v) = big.get_item(x)? {
            return Ok(Some(Hid { value: v.extract()?, big: true }));
        }
        if !store {
            return Ok(None);
        }
        let v = big.len() as i64;
        big.set_item(x, v)?;
        Ok(Some(Hid { value: v, big: true }))
    }

    /// The first `n` hash ids of `ids`.
    fn hids(&self, ids: &Ids<'_>, n: usize, store: bool) -> PyResult<Vec<Option<Hid>>> {
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            out.push(self.hid(&ids.get(i)?, store)?);
        }
        Ok(out)
    }

    /// (ids, blocks) for a prefix of `tokens` tokens: `min(tokens // block_tokens, len(ids))`.
    fn prefix(&self, hash_ids: &Bound<'_, PyAny>, tokens: i64, store: bool) -> PyResult<(Vec<Option<Hid>>, i64)> {
        let ids = Ids::of(hash_ids)?;
        let blocks = floor_div(nonnegative(tokens, "tokens")?, self.block_tokens).min(ids.len() as i64);
        Ok((self.hids(&ids, blocks as usize, store)?, blocks))
    }

    /// The slots of a prefix in `_keys` order (the state, then leaf to root), present ones only.
    fn present(&self, ids: &[Option<Hid>], blocks: i64) -> Vec<u32> {
        let mut out = Vec::with_capacity(blocks as usize + 1);
        if self.state_bytes != 0 && blocks > 0 {
            if let Some(s) = self.find(STATE, blocks, ids[blocks as usize - 1]) {
                out.push(s);
            }
        }
        if self.block_bytes != 0 {
            for i in (0..blocks).rev() {
                if let Some(s) = self.find(BLOCK, i, ids[i as usize]) {
                    out.push(s);
                }
            }
        }
        out
    }

    fn match_blocks(&self, hash_ids: &Bound<'_, PyAny>, limit: i64) -> PyResult<(i64, i64)> {
        let ids = Ids::of(hash_ids)?;
        let n = (limit.max(0) as usize).min(ids.len());
        let mut hids: Vec<Option<Hid>> = Vec::with_capacity(n);
        let mut full: i64 = 0;
        for i in 0..n {
            let h = self.hid(&ids.get(i)?, false)?;
            hids.push(h);
            if self.find(BLOCK, full, h).is_none() {
                break;
            }
            full += 1;
        }
        if self.state_bytes == 0 {
            return Ok((full, full));
        }
        for k in (1..=full).rev() {
            if self.find(STATE, k, hids[k as usize - 1]).is_some() {
                return Ok((full, k));
            }
        }
        Ok((full, 0))
    }

    fn make_room(&mut self, nbytes: i64) -> bool {
        let mut free = self.capacity_bytes - self.used_bytes;
        if nbytes <= free {
            return true;
        }
        let evictable = self.used_bytes - self.held_bytes - self.pinned_entry_bytes;
        if nbytes > free + evictable {
            return false;
        }
        let mut victims = Vec::new();
        let mut s = self.head;
        while s != NIL && free < nbytes {
            let slot = &self.slots[s as usize];
            if slot.pins == 0 {
                victims.push(s);
                free += slot.nbytes;
            }
            s = slot.next;
        }
        for v in victims {
            let nb = self.slots[v as usize].nbytes;
            self.remove(v);
            self.used_bytes -= nb;
            self.stats.evicted_bytes += nb;
            self.stats.evictions += 1;
        }
        true
    }

    fn refresh(&mut self, ids: &[Option<Hid>], blocks: i64) {
        for s in self.present(ids, blocks) {
            self.move_to_end(s);
        }
    }

    /// Where a prompt's entries are now: its state's slot (if the pool keeps states) and each
    /// block's (if it keeps blocks), looked up once for all of `insert`.
    fn slots_of(&self, ids: &[Option<Hid>], blocks: i64) -> (Option<u32>, Vec<Option<u32>>) {
        let state = if self.state_bytes != 0 { self.find(STATE, blocks, ids[blocks as usize - 1]) } else { None };
        let mut out = Vec::new();
        if self.block_bytes != 0 {
            out.extend((0..blocks).map(|i| self.find(BLOCK, i, ids[i as usize])));
        }
        (state, out)
    }

    /// `insert` where everything fits: `state`, `found`, where its entries were (`slots_of`;
    /// still so: nothing has removed an entry of this prompt since).
    fn insert_fitting(&mut self, ids: &[Option<Hid>], blocks: i64, state: Option<u32>, found: &[Option<u32>]) -> i64 {
        let (sb, bb) = (self.state_bytes, self.block_bytes);
        let mut added = 0;
        if sb != 0 {
            match state {
                Some(s) => self.move_to_end(s),
                None => {
                    let hid = ids[blocks as usize - 1].expect("stored");
                    self.add(Key::stored(STATE, blocks, hid), sb);
                    added += sb;
                }
            }
        }
        if bb != 0 {
            for i in (0..blocks).rev() {
                match found[i as usize] {
                    Some(s) => self.move_to_end(s),
                    None => {
                        let hid = ids[i as usize].expect("stored");
                        self.add(Key::stored(BLOCK, i, hid), bb);
                        added += bb;
                    }
                }
            }
        }
        self.used_bytes += added;
        self.stats.inserted_bytes += added;
        added
    }

    /// Pin `held` once more for `owner` (its entries are then never evicted until it unpins).
    fn pin_slots(&mut self, owner: &str, held: Vec<u32>) {
        for &s in &held {
            let slot = &mut self.slots[s as usize];
            if slot.pins == 0 {
                self.pinned_entry_bytes += slot.nbytes;
            }
            slot.pins += 1;
        }
        match self.pins.get_mut(owner) {
            Some(mine) => mine.extend(held),
            None => {
                self.pins.insert(owner.to_owned(), held);
            }
        }
    }
}

#[pymethods]
impl PrefixPool {
    #[new]
    fn new(
        py: Python<'_>,
        capacity_bytes: i64,
        block_tokens: i64,
        block_bytes: i64,
        state_bytes: i64,
    ) -> PyResult<Self> {
        if block_tokens <= 0 {
            return Err(PyValueError::new_err(format!("block_tokens must be > 0, got {block_tokens}")));
        }
        Ok(PrefixPool {
            capacity_bytes,
            block_tokens,
            block_bytes,
            state_bytes,
            used_bytes: 0,
            stats: PoolStats::default(),
            index: KeyIndex::default(),
            slots: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            pins: FxHashMap::default(),
            holds_: FxHashMap::default(),
            pinned_entry_bytes: 0,
            held_bytes: 0,
            big: PyDict::new(py).unbind(),
        })
    }

    #[getter]
    fn stats(&self) -> PoolStats {
        self.stats.clone()
    }

    #[getter]
    fn pinned_bytes(&self) -> i64 {
        self.pinned_entry_bytes + self.held_bytes
    }

    #[pyo3(name = "match")]
    fn match_(&self, hash_ids: &Bound<'_, PyAny>, input_tokens: i64) -> PyResult<PoolMatch> {
        let bt = self.block_tokens;
        let (full, usable) = self.match_blocks(hash_ids, floor_div((input_tokens - 1).max(0), bt))?;
        Ok(PoolMatch { tokens: usable * bt, full_tokens: full * bt })
    }

    fn usable_tokens(&self, hash_ids: &Bound<'_, PyAny>, input_tokens: i64) -> PyResult<i64> {
        let bt = self.block_tokens;
        Ok(self.match_blocks(hash_ids, floor_div((input_tokens - 1).max(0), bt))?.1 * bt)
    }

    fn holds(&self, key: (String, i64, Bound<'_, PyAny>)) -> PyResult<bool> {
        let kind = match key.0.as_str() {
            "b" => BLOCK,
            "s" => STATE,
            _ => return Ok(false),
        };
        Ok(self.find(kind, key.1, self.hid(&key.2, false)?).is_some())
    }

    fn state_lengths(&self) -> Vec<i64> {
        let mut out: Vec<i64> =
            self.index.keys().filter(|k| k.kind == STATE).map(|k| i64::from(k.pos) * self.block_tokens).collect();
        out.sort_unstable();
        out
    }

    fn touch(&mut self, hash_ids: &Bound<'_, PyAny>, tokens: i64) -> PyResult<()> {
        let (ids, blocks) = self.prefix(hash_ids, tokens, false)?;
        self.stats.lookups += 1;
        self.stats.hit_tokens += blocks * self.block_tokens;
        self.refresh(&ids, blocks);
        Ok(())
    }

    fn insert(&mut self, hash_ids: &Bound<'_, PyAny>, input_tokens: i64) -> PyResult<i64> {
        let (ids, blocks) = self.prefix(hash_ids, input_tokens, true)?;
        if self.capacity_bytes <= 0 || blocks == 0 {
            return Ok(0);
        }
        let (bb, sb) = (self.block_bytes, self.state_bytes);
        let (state, found) = self.slots_of(&ids, blocks);
        if self.capacity_bytes - self.used_bytes >= blocks * bb + sb {
            return Ok(self.insert_fitting(&ids, blocks, state, &found));
        }
        // As the Python pool: refresh what is there, then room for every missing entry at once
        // where older entries can give it, else block by block as far as it goes.
        if let Some(s) = state {
            self.move_to_end(s);
        }
        for &s in found.iter().rev().flatten() {
            self.move_to_end(s);
        }
        if bb != 0 {
            let unpinned = |s: u32| {
                let slot = &self.slots[s as usize];
                if slot.pins == 0 {
                    slot.nbytes
                } else {
                    0
                }
            };
            let missing = found.iter().filter(|s| s.is_none()).count() as i64;
            let mut own: i64 = found.iter().flatten().map(|&s| unpinned(s)).sum();
            let mut need = missing * bb;
            if sb != 0 {
                match state {
                    None => need += sb,
                    Some(s) => own += unpinned(s),
                }
            }
            let free = self.capacity_bytes - self.used_bytes;
            let older = self.used_bytes - self.held_bytes - self.pinned_entry_bytes - own;
            // make_room takes the oldest unpinned entries first, and this prompt's are the newest
            // now: `older` covers what it takes, so none of them goes and `found` stands.
            if free >= need || (need <= free + older && self.make_room(need)) {
                return Ok(self.insert_fitting(&ids, blocks, state, &found));
            }
        }
        let mut added = 0;
        let mut present = 0;
        for i in 0..blocks {
            let hid = ids[i as usize].expect("stored");
            if bb == 0 || self.find(BLOCK, i, Some(hid)).is_some() {
                present = i + 1;
                continue;
            }
            if self.capacity_bytes - self.used_bytes < bb && !self.make_room(bb) {
                self.stats.refused_bytes += bb * (blocks - i);
                break;
            }
            self.add(Key::stored(BLOCK, i, hid), bb);
            self.used_bytes += bb;
            added += bb;
            present = i + 1;
        }
        if sb != 0 && present == blocks {
            let hid = ids[blocks as usize - 1].expect("stored");
            if self.find(STATE, blocks, Some(hid)).is_none() {
                if self.make_room(sb) {
                    self.add(Key::stored(STATE, blocks, hid), sb);
                    self.used_bytes += sb;
                    added += sb;
                } else {
                    self.stats.refused_bytes += sb;
                }
            }
        }
        self.stats.inserted_bytes += added;
        self.refresh(&ids, present);
        Ok(added)
    }

    fn touch_and_pin(&mut self, owner: &str, hash_ids: &Bound<'_, PyAny>, tokens: i64) -> PyResult<()> {
        let (ids, blocks) = self.prefix(hash_ids, tokens, false)?;
        self.stats.lookups += 1;
        self.stats.hit_tokens += blocks * self.block_tokens;
        let held = self.present(&ids, blocks);
        for &s in &held {
            self.move_to_end(s);
        }
        self.pin_slots(owner, held);
        Ok(())
    }

    fn pin(&mut self, owner: &str, hash_ids: &Bound<'_, PyAny>, tokens: i64) -> PyResult<()> {
        let (ids, blocks) = self.prefix(hash_ids, tokens, false)?;
        let held = self.present(&ids, blocks);
        self.pin_slots(owner, held);
        Ok(())
    }

    fn unpin(&mut self, owner: &str) {
        let Some(held) = self.pins.remove(owner) else { return };
        let mut freed = 0;
        for s in held {
            let slot = &mut self.slots[s as usize];
            if slot.pins > 0 {
                slot.pins -= 1;
                if slot.pins == 0 {
                    freed += slot.nbytes;
                }
            }
        }
        self.pinned_entry_bytes -= freed;
    }

    fn hold(&mut self, owner: &str, nbytes: i64) -> bool {
        if nbytes <= 0 || self.holds_.contains_key(owner) {
            return true;
        }
        if !self.make_room(nbytes) {
            self.stats.refused_bytes += nbytes;
            return false;
        }
        self.holds_.insert(owner.to_owned(), nbytes);
        self.held_bytes += nbytes;
        self.used_bytes += nbytes;
        true
    }

    fn release(&mut self, owner: &str) {
        let held = self.holds_.remove(owner).unwrap_or(0);
        self.held_bytes -= held;
        self.used_bytes -= held;
        self.unpin(owner);
    }

    fn tail_bytes(&self, input_tokens: i64) -> i64 {
        let partial = input_tokens.rem_euclid(self.block_tokens);
        let per_token = self.block_bytes as f64 / self.block_tokens as f64;
        (partial as f64 * per_token).round_ties_even() as i64 + self.state_bytes
    }

    /// Accounting invariants, and the LRU list against the index (tests call this after every step).
    fn check(&self) -> PyResult<()> {
        let fail = |what: String| Err(PyAssertionError::new_err(what));
        let mut total = 0;
        let mut pinned = 0;
        let mut n = 0;
        let mut s = self.head;
        let mut prev = NIL;
        while s != NIL {
            let slot = &self.slots[s as usize];
            if slot.prev != prev || self.index.get(&slot.key) != Some(&s) {
                return fail(format!("LRU list broken at slot {s}"));
            }
            total += slot.nbytes;
            if slot.pins != 0 {
                pinned += slot.nbytes;
            }
            n += 1;
            prev = s;
            s = slot.next;
        }
        if prev != self.tail || n != self.index.len() {
            return fail(format!("LRU list holds {n} entries, the index {}", self.index.len()));
        }
        let holds: i64 = self.holds_.values().sum();
        if total + holds != self.used_bytes {
            return fail(format!("({}, {})", total + holds, self.used_bytes));
        }
        if pinned != self.pinned_entry_bytes {
            return fail(format!("({pinned}, {})", self.pinned_entry_bytes));
        }
        if holds != self.held_bytes {
            return fail(format!("({holds}, {})", self.held_bytes));
        }
        if !(0 <= self.used_bytes && self.used_bytes <= self.capacity_bytes.max(0)) {
            return fail(format!("({}, {})", self.used_bytes, self.capacity_bytes));
        }
        Ok(())
    }

    /// Every entry oldest first as ("b"|"s", position, hash id, bytes, pins): what the
    /// differential tests compare with the Python pool's `OrderedDict`.
    fn entries(&self, py: Python<'_>) -> PyResult<Vec<EntryView>> {
        let mut back: FxHashMap<i64, Py<PyAny>> = FxHashMap::default();
        for (k, v) in self.big.bind(py).iter() {
            back.insert(v.extract()?, k.unbind());
        }
        let mut out = Vec::with_capacity(self.index.len());
        let mut s = self.head;
        while s != NIL {
            let slot = &self.slots[s as usize];
            let k = slot.key;
            let hid = if k.big { back[&k.value].clone_ref(py) } else { k.value.into_pyobject(py)?.into_any().unbind() };
            out.push((if k.kind == STATE { "s" } else { "b" }, i64::from(k.pos), hid, slot.nbytes, slot.pins));
            s = slot.next;
        }
        Ok(out)
    }
}
