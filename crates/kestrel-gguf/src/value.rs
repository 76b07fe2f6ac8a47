use std::fmt;

/// The type tag of a metadata value, with its GGUF on-disk id (0..=12).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// Every value type, in id order.
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The GGUF on-disk id.
    pub fn id(self) -> u32 {
        match self {
            ValueType::U8 => 0,
            ValueType::I8 => 1,
            ValueType::U16 => 2,
            ValueType::I16 => 3,
            ValueType::U32 => 4,
            ValueType::I32 => 5,
            ValueType::F32 => 6,
            ValueType::Bool => 7,
            ValueType::String => 8,
            ValueType::Array => 9,
            ValueType::U64 => 10,
            ValueType::I64 => 11,
            ValueType::F64 => 12,
        }
    }

    /// The type for an on-disk id, or `None` if the id is unknown.
    pub fn from_id(id: u32) -> Option<ValueType> {
        Self::ALL.get(usize::try_from(id).ok()?).copied()
    }

    /// Short lower-case name (`u32`, `string`, `array`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }

    /// Size in bytes of one value of this type on disk, for fixed-size types.
    pub fn fixed_size(self) -> Option<usize> {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => Some(1),
            ValueType::U16 | ValueType::I16 => Some(2),
            ValueType::U32 | ValueType::I32 | ValueType::F32 => Some(4),
            ValueType::U64 | ValueType::I64 | ValueType::F64 => Some(8),
            ValueType::String | ValueType::Array => None,
        }
    }

    /// The fewest bytes one value of this type can take on disk: a string is at least its
    /// 8-byte length, an array at least its 4-byte element type and 8-byte count.
    pub(crate) fn min_encoded_size(self) -> usize {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            fixed => fixed.fixed_size().unwrap_or(1),
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value.
///
/// `Array(element_type, elements)`: every element has type `element_type`; arrays of arrays
/// are allowed (the inner arrays may each have their own element type).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A numeric value widened without loss, for the coercions below.
enum Num {
    Unsigned(u64),
    Signed(i64),
    Float(f64),
}

impl Value {
    /// The type tag of this value.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    fn num(&self) -> Option<Num> {
        Some(match *self {
            Value::U8(v) => Num::Unsigned(v.into()),
            Value::U16(v) => Num::Unsigned(v.into()),
            Value::U32(v) => Num::Unsigned(v.into()),
            Value::U64(v) => Num::Unsigned(v),
            Value::I8(v) => Num::Signed(v.into()),
            Value::I16(v) => Num::Signed(v.into()),
            Value::I32(v) => Num::Signed(v.into()),
            Value::I64(v) => Num::Signed(v),
            Value::F32(v) => Num::Float(v.into()),
            Value::F64(v) => Num::Float(v),
            Value::Bool(_) | Value::String(_) | Value::Array(..) => return None,
        })
    }

    /// The value as a `u64`: any integer that is not negative, or a float holding a whole
    /// number in range. `None` for non-numeric values or values out of range.
    pub fn as_u64(&self) -> Option<u64> {
        match self.num()? {
            Num::Unsigned(v) => Some(v),
            Num::Signed(v) => u64::try_from(v).ok(),
            // 2^64 is exactly representable; anything below it with no fraction fits.
            Num::Float(v) => (v.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&v))
                .then_some(v as u64),
        }
    }

    /// The value as an `i64`: any integer in range, or a float holding a whole number in range.
    pub fn as_i64(&self) -> Option<i64> {
        match self.num()? {
            Num::Unsigned(v) => i64::try_from(v).ok(),
            Num::Signed(v) => Some(v),
            Num::Float(v) => (v.fract() == 0.0
                && (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&v))
            .then_some(v as i64),
        }
    }

    /// The value as an `f64` (integers are converted, rounding above 2^53).
    pub fn as_f64(&self) -> Option<f64> {
        match self.num()? {
            Num::Unsigned(v) => Some(v as f64),
            Num::Signed(v) => Some(v as f64),
            Num::Float(v) => Some(v),
        }
    }

    /// The value as an `f32` (rounded to nearest; `None` for finite `f64`s beyond f32 range).
    pub fn as_f32(&self) -> Option<f32> {
        if let Value::F32(v) = self {
            return Some(*v);
        }
        let wide = self.as_f64()?;
        let narrow = wide as f32;
        (narrow.is_finite() || !wide.is_finite()).then_some(narrow)
    }

    /// The string, for `String` values.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The flag, for `Bool` values.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The elements, for `Array` values.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, items) => Some(items),
            _ => None,
        }
    }

    /// The declared element type, for `Array` values.
    pub fn array_type(&self) -> Option<ValueType> {
        match self {
            Value::Array(ty, _) => Some(*ty),
            _ => None,
        }
    }
}

impl From<u8> for Value {
    fn from(v: u8) -> Self {
        Value::U8(v)
    }
}
impl From<i8> for Value {
    fn from(v: i8) -> Self {
        Value::I8(v)
    }
}
impl From<u16> for Value {
    fn from(v: u16) -> Self {
        Value::U16(v)
    }
}
impl From<i16> for Value {
    fn from(v: i16) -> Self {
        Value::I16(v)
    }
}
impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::U32(v)
    }
}
impl From<i32> for Value {
    fn from(v: i32) -> Self {
        Value::I32(v)
    }
}
impl From<f32> for Value {
    fn from(v: f32) -> Self {
        Value::F32(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::String(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::String(v.to_owned())
    }
}
impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::U64(v)
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::I64(v)
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::F64(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The exact integer a value holds, if it holds one (floats: only whole, finite ones
    /// below 2^127, where `as i128` is exact).
    fn exact_integer(v: &Value) -> Option<i128> {
        match *v {
            Value::U8(x) => Some(x.into()),
            Value::I8(x) => Some(x.into()),
            Value::U16(x) => Some(x.into()),
            Value::I16(x) => Some(x.into()),
            Value::U32(x) => Some(x.into()),
            Value::I32(x) => Some(x.into()),
            Value::U64(x) => Some(x.into()),
            Value::I64(x) => Some(x.into()),
            Value::F32(x) => f64::from(x).try_into_whole(),
            Value::F64(x) => x.try_into_whole(),
            _ => None,
        }
    }

    trait Whole {
        fn try_into_whole(self) -> Option<i128>;
    }
    impl Whole for f64 {
        fn try_into_whole(self) -> Option<i128> {
            (self.is_finite() && self.trunc() == self && self.abs() < 1.7e38)
                .then_some(self as i128)
        }
    }

    fn random_numeric(rng: &mut StdRng) -> Value {
        // Floats: mostly whole numbers of all magnitudes, some with fractions, some special.
        let float = |rng: &mut StdRng| -> f64 {
            match rng.random_range(0..4) {
                0 => (rng.random::<i64>() >> rng.random_range(0..64)) as f64,
                1 => rng.random::<f64>() * 2e19 - 1e19,
                2 => f64::from_bits(rng.random()),
                _ => [
                    0.5,
                    -0.0,
                    2f64.powi(63),
                    2f64.powi(64),
                    -(2f64.powi(63)),
                    f64::NAN,
                ][rng.random_range(0..6)],
            }
        };
        match rng.random_range(0..10) {
            0 => Value::U8(rng.random()),
            1 => Value::I8(rng.random()),
            2 => Value::U16(rng.random()),
            3 => Value::I16(rng.random()),
            4 => Value::U32(rng.random()),
            5 => Value::I32(rng.random()),
            6 => Value::U64(rng.random::<u64>() >> rng.random_range(0..64)),
            7 => Value::I64(rng.random::<i64>() >> rng.random_range(0..64)),
            8 => Value::F32(float(rng) as f32),
            _ => Value::F64(float(rng)),
        }
    }

    #[test]
    fn integer_coercions_match_exact_arithmetic() {
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..200_000 {
            let v = random_numeric(&mut rng);
            let exact = exact_integer(&v);
            assert_eq!(
                v.as_u64(),
                exact.and_then(|x| u64::try_from(x).ok()),
                "{v:?}"
            );
            assert_eq!(
                v.as_i64(),
                exact.and_then(|x| i64::try_from(x).ok()),
                "{v:?}"
            );
        }
    }

    #[test]
    fn float_coercions() {
        let mut rng = StdRng::seed_from_u64(2);
        for _ in 0..200_000 {
            let v = random_numeric(&mut rng);
            let wide = v.as_f64().unwrap();
            match v {
                Value::F32(x) => assert_eq!(v.as_f32().unwrap().to_bits(), x.to_bits()),
                Value::F64(x) => {
                    assert_eq!(wide.to_bits(), x.to_bits());
                    // Finite values too large for f32 have no f32 form.
                    let fits = !x.is_finite() || x.abs() <= f64::from(f32::MAX) * (1.0 + 1e-9);
                    assert_eq!(v.as_f32().is_some(), fits, "{v:?}");
                }
                _ => {
                    let exact = exact_integer(&v).unwrap();
                    // Conversion to f64 rounds to nearest: within half an ulp.
                    assert!(
                        (wide as i128 - exact).unsigned_abs() as f64 <= wide.abs() * f64::EPSILON
                    );
                    assert!(v.as_f32().is_some());
                }
            }
        }
        for v in [
            Value::Bool(true),
            Value::String("1".into()),
            Value::Array(ValueType::U8, vec![Value::U8(1)]),
        ] {
            assert_eq!(
                (v.as_u64(), v.as_i64(), v.as_f64(), v.as_f32()),
                (None, None, None, None)
            );
        }
    }

    #[test]
    fn type_ids_round_trip() {
        for (i, ty) in ValueType::ALL.into_iter().enumerate() {
            assert_eq!(ty.id() as usize, i);
            assert_eq!(ValueType::from_id(ty.id()), Some(ty));
        }
        assert_eq!(ValueType::from_id(13), None);
        assert_eq!(ValueType::from_id(u32::MAX), None);
    }
}
