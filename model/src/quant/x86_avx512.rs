//! placeholder
use super::{QuantFormat, RowFn};
pub(super) fn row_fn(_f: QuantFormat) -> Option<RowFn> {
    None
}
