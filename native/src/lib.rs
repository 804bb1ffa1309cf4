//! Compiled twins of prfaas-testbed's core mechanisms.
//!
//! Each type here does exactly what the pure-Python module it names does, decision for decision
//! and byte for byte; the Python module stays the reference (and what runs where this extension
//! is not built), and the differential tests in `tests/test_native_*.py` hold the two together.

use pyo3::prelude::*;

/// `PartialEq`, `Eq` and `PartialOrd` from the type's own `Ord` (a heap entry's order is its
/// `Ord`, keys compared in turn, reversed for `BinaryHeap`).
macro_rules! order_by_ord {
    ($($t:ty),+) => {$(
        impl PartialEq for $t {
            fn eq(&self, o: &Self) -> bool {
                self.cmp(o) == std::cmp::Ordering::Equal
            }
        }
        impl Eq for $t {}
        impl PartialOrd for $t {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
    )+};
}

mod decision_columns;
mod decode_batch;
mod event_loop;
mod flow_net;
mod huge_pages;
mod mooncake_rows;
mod prefix_pool;
mod record_columns;
mod record_rows;
mod series_lines;

#[global_allocator]
static ALLOCATOR: huge_pages::HugePages = huge_pages::HugePages;

/// Bumped whenever a twin's behaviour or interface changes.
const ABI: u32 = 12;

#[pymodule]
fn testbed_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // What `testbed.core.native` expects: a build from older sources is not used.
    m.add("ABI", ABI)?;
    m.add_class::<decode_batch::DecodeBatch>()?;
    m.add_class::<event_loop::EventLoop>()?;
    m.add_class::<flow_net::FlowNet>()?;
    m.add_class::<flow_net::NetPath>()?;
    m.add_class::<prefix_pool::PrefixPool>()?;
    m.add_class::<prefix_pool::PoolMatch>()?;
    m.add_class::<prefix_pool::PoolStats>()?;
    m.add_class::<record_rows::RecordRows>()?;
    m.add_function(wrap_pyfunction!(mooncake_rows::mooncake_rows, m)?)?;
    m.add_function(wrap_pyfunction!(mooncake_rows::mooncake_scan, m)?)?;
    m.add_function(wrap_pyfunction!(record_columns::record_columns, m)?)?;
    m.add_function(wrap_pyfunction!(decision_columns::decision_columns, m)?)?;
    m.add_function(wrap_pyfunction!(series_lines::series_lines, m)?)?;
    Ok(())
}
