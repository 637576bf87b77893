//! The batch KV cache's row bookkeeping: joins, shifts, compaction, masks
//! and the holes of rows that kept fewer verified tokens.

use super::*;

fn seq(len: usize, base: f32) -> Array {
    let data: Vec<f32> = (0..len * 2).map(|i| base + i as f32).collect();
    Array::from_slice(&data, &[1, 1, len as i32, 2])
}

fn row(c: &BatchKvCache, r: usize) -> Vec<f32> {
    let (k, _) = (c.keys.clone().unwrap(), ());
    let from = c.pad(r) as i32;
    let part = k
        .try_index((r as i32..r as i32 + 1, .., from..c.idx as i32, ..))
        .unwrap();
    part.as_slice::<f32>().to_vec()
}

#[test]
fn rows_keep_their_own_history_through_joins_shifts_and_compaction() {
    let mut c = BatchKvCache::new(3);
    c.write_row(0, &seq(2, 0.0), &seq(2, 0.0)).unwrap();
    // A longer newcomer shifts row 0 right.
    c.write_row(2, &seq(4, 100.0), &seq(4, 100.0)).unwrap();
    assert_eq!((c.columns(), c.row_len(0), c.row_len(2)), (4, 2, 4));
    assert_eq!(row(&c, 0), seq(2, 0.0).as_slice::<f32>());
    assert_eq!(row(&c, 2), seq(4, 100.0).as_slice::<f32>());
    let pos = c.positions().unwrap().unwrap();
    assert_eq!(pos.as_slice::<i32>(), &[2, 0, 4]);
    // One decode step for all rows.
    let step = Array::from_slice(&[7f32, 7., 8., 8., 9., 9.], &[3, 1, 1, 2]);
    c.update_and_fetch(&step, &step).unwrap();
    assert_eq!(row(&c, 0), [0., 1., 2., 3., 7., 7.]);
    assert_eq!(c.positions().unwrap().unwrap().as_slice::<i32>()[2], 5);
    // Row 2 leaves; compaction keeps row 0 and drops the columns it masks.
    BatchKvCache::free_row(&mut c, 2);
    c.select_rows(&[0]).unwrap();
    assert_eq!((c.rows(), c.columns(), c.row_len(0)), (1, 3, 3));
    assert_eq!(row(&c, 0), [0., 1., 2., 3., 7., 7.]);
    assert!(matches!(c.mask(1).unwrap(), AttentionMask::None));
}

/// Row `r`'s values in the columns its one-query mask lets it see.
fn seen(c: &BatchKvCache, r: usize) -> Vec<f32> {
    let mask = match c.mask(1).unwrap() {
        AttentionMask::Array(m) => m,
        _ => return row(c, r),
    };
    // The mask also covers the next column (the query's own).
    let m = mask.try_index(r as i32).unwrap();
    let m: Vec<bool> = ops::reshape(&m, &[-1]).unwrap().as_slice::<bool>().to_vec();
    let k = c.keys.clone().unwrap();
    let part = k
        .try_index((r as i32..r as i32 + 1, .., ..c.idx as i32, ..))
        .unwrap();
    let vals: Vec<f32> = part.as_slice::<f32>().to_vec();
    (0..c.idx)
        .filter(|&col| m[col])
        .flat_map(|col| vals[2 * col..2 * col + 2].to_vec())
        .collect()
}

/// A verify window: the columns `rows` written, then `drop[r]` of them
/// taken back from row `r`.
fn window(c: &mut BatchKvCache, rows: &[&[f32]], drop: &[usize]) {
    let w = columns(rows);
    c.update_and_fetch(&w, &w).unwrap();
    c.trim_rows(drop).unwrap();
}

fn columns(rows: &[&[f32]]) -> Array {
    // [rows, 1, T, 2]: each value twice (the head size is 2).
    let t = rows[0].len();
    let data: Vec<f32> = rows
        .iter()
        .flat_map(|r| r.iter().flat_map(|&x| [x, x]))
        .collect();
    Array::from_slice(&data, &[rows.len() as i32, 1, t as i32, 2])
}

#[test]
fn rows_keep_their_own_accepted_prefix_of_a_verified_window() {
    let mut c = BatchKvCache::new(2);
    c.write_row(0, &seq(2, 0.0), &seq(2, 0.0)).unwrap();
    c.write_row(1, &seq(3, 100.0), &seq(3, 100.0)).unwrap();
    // A verify window of 3 tokens for both rows.
    let w = columns(&[&[10., 11., 12.], &[110., 111., 112.]]);
    c.update_and_fetch(&w, &w).unwrap();
    // Row 0 keeps 3, row 1 keeps 1: the shared column moves by 3,
    // row 1 hides the 2 it rejected.
    c.trim_rows(&[0, 2]).unwrap();
    assert_eq!(
        (c.columns(), c.row_len(0), c.row_len(1), c.holes(1)),
        (6, 5, 4, 2)
    );
    assert_eq!(c.positions().unwrap().unwrap().as_slice::<i32>(), &[5, 4]);
    assert_eq!(seen(&c, 0), [0., 1., 2., 3., 10., 10., 11., 11., 12., 12.]);
    assert_eq!(
        seen(&c, 1),
        [100., 101., 102., 103., 104., 105., 110., 110.]
    );
    // A second window: row 1 keeps 2 of 2, row 0 keeps 1; the holes of
    // row 1 stay hidden, the new ones of row 0 too.
    window(&mut c, &[&[20., 21.], &[120., 121.]], &[1, 0]);
    assert_eq!(
        (c.row_len(0), c.row_len(1), c.holes(0), c.holes(1)),
        (6, 6, 1, 2)
    );
    assert_eq!(
        seen(&c, 0),
        [0., 1., 2., 3., 10., 10., 11., 11., 12., 12., 20., 20.]
    );
    assert_eq!(
        seen(&c, 1),
        [100., 101., 102., 103., 104., 105., 110., 110., 120., 120., 121., 121.]
    );
    // Both drop the same count: no new holes, the shared column goes back.
    window(&mut c, &[&[30., 31.], &[130., 131.]], &[1, 1]);
    assert_eq!(
        (c.holes(0), c.holes(1), c.row_len(0), c.row_len(1)),
        (1, 2, 7, 7)
    );
    // A plain decode step after it sees the kept tokens and no holes.
    let step = columns(&[&[40.], &[140.]]);
    c.update_and_fetch(&step, &step).unwrap();
    assert_eq!(
        seen(&c, 1),
        [
            100., 101., 102., 103., 104., 105., 110., 110., 120., 120., 121., 121., 130., 130.,
            140., 140.
        ]
    );
    // Squeezing moves the seen columns together and changes nothing seen.
    let before: Vec<Vec<f32>> = (0..2).map(|r| seen(&c, r)).collect();
    c.squeeze().unwrap();
    assert_eq!((c.holes(0), c.holes(1)), (0, 0));
    assert!(c.holes.is_none());
    assert_eq!(c.positions().unwrap().unwrap().as_slice::<i32>(), &[8, 8]);
    for (r, b) in before.iter().enumerate() {
        assert_eq!(&seen(&c, r), b, "row {r}");
    }
    // A row that leaves and a newcomer in its slot start with no holes.
    c.trim_rows(&[0, 0]).unwrap();
    BatchKvCache::free_row(&mut c, 0);
    c.write_row(0, &seq(2, 50.0), &seq(2, 50.0)).unwrap();
    assert_eq!(c.holes(0), 0);
    assert_eq!(seen(&c, 0), seq(2, 50.0).as_slice::<f32>());
}

#[test]
fn many_holes_are_squeezed_out_and_a_bad_count_is_refused() {
    let mut c = BatchKvCache::new(2);
    c.write_row(0, &seq(1, 0.0), &seq(1, 0.0)).unwrap();
    c.write_row(1, &seq(1, 100.0), &seq(1, 100.0)).unwrap();
    let mut want1 = vec![100f32, 101.];
    for i in 0..SQUEEZE_MIN_HOLES {
        let v = i as f32;
        window(
            &mut c,
            &[&[1000. + v, 1001. + v], &[2000. + v, 2001. + v]],
            &[0, 1],
        );
        want1.extend([2000. + v, 2000. + v]);
    }
    // Row 1 reached the squeeze rule's count; it was squeezed.
    assert_eq!(c.holes(1), 0);
    assert_eq!(seen(&c, 1), want1);
    assert_eq!(c.row_len(1), 1 + SQUEEZE_MIN_HOLES);
    assert!(c.trim_rows(&[1]).is_err(), "one count for two rows");
}

#[test]
fn the_mask_hides_each_rows_padding_only() {
    let mut c = BatchKvCache::new(2);
    c.write_row(0, &seq(1, 0.0), &seq(1, 0.0)).unwrap();
    c.write_row(1, &seq(3, 0.0), &seq(3, 0.0)).unwrap();
    let AttentionMask::Array(m) = c.mask(1).unwrap() else {
        panic!("a padded batch needs a mask")
    };
    assert_eq!(m.shape(), &[2, 1, 1, 4]);
    let m: Vec<bool> = m.as_slice::<bool>().to_vec();
    assert_eq!(m, [false, false, true, true, true, true, true, true]);
}

/// A verify window that crosses the buffers' end: the mask is taken before
/// the write grows them, so it covers columns the holes never had.
#[test]
fn a_window_past_the_buffers_end_masks_the_holes_it_had_and_none_beyond() {
    let mut c = BatchKvCache::new(2);
    let len = KV_STEP - 5;
    c.write_row(0, &seq(len, 0.0), &seq(len, 0.0)).unwrap();
    c.write_row(1, &seq(len, 0.0), &seq(len, 0.0)).unwrap();
    window(&mut c, &[&[1., 2., 3.], &[4., 5., 6.]], &[0, 2]);
    assert_eq!(
        (c.columns(), c.holes(1), c.capacity()),
        (KV_STEP - 2, 2, KV_STEP)
    );
    let AttentionMask::Array(m) = c.mask(4).unwrap() else {
        panic!("a batch with holes needs a mask")
    };
    assert_eq!(m.shape(), &[2, 1, 4, KV_STEP as i32 + 2]);
    // Row 1, its last query: everything but its two holes.
    let last = m.try_index((1, 0, 3)).unwrap();
    let hidden: Vec<usize> = (last.as_slice::<bool>().iter().enumerate())
        .filter(|(_, &v)| !v)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(hidden, [KV_STEP - 4, KV_STEP - 3]);
    // The window's write grows the buffers and the mask fits its keys.
    let w = columns(&[&[7., 8., 9., 10.], &[11., 12., 13., 14.]]);
    let (k, _) = c.update_and_fetch(&w, &w).unwrap();
    assert_eq!(k.shape()[2], m.shape()[3]);
}
