//! Reading a message as MassTransit reads it: System.Text.Json with
//! `PropertyNameCaseInsensitive = true` (MT/Serialization/SystemTextJsonMessageSerializer.cs)
//! matches a JSON property to a field whatever its case, so a producer on
//! the PascalCase naming policy, or on Newtonsoft, reaches a camelCase
//! contract.
//!
//! serde matches names exactly, so the deserializer is wrapped instead of
//! the document rewritten: where the contract's type reads a struct, a key
//! that names none of its fields exactly but one of them in another case
//! is read as that field. Nothing else changes: a dictionary's keys (a
//! map, not a struct), string values, and a key that matches no field in
//! any case reach the type as they are. A key that already matches, the
//! common case, costs a look through the struct's field names.

use std::fmt;

use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, Visitor,
};

/// `T` from the JSON `body`, its structs' fields matched in any case.
pub(crate) fn from_slice<T: DeserializeOwned>(body: &[u8]) -> serde_json::Result<T> {
    let mut json = serde_json::Deserializer::from_slice(body);
    let value = T::deserialize(AnyCase(&mut json))?;
    json.end()?;
    Ok(value)
}

/// The field of `fields` that `key` names in another case; `None` when it
/// names one exactly, or none at all (then it goes on as it is).
fn field_named(key: &str, fields: &'static [&'static str]) -> Option<&'static str> {
    if fields.contains(&key) {
        return None;
    }
    fields.iter().copied().find(|field| same_but_case(field, key))
}

/// Whether `a` and `b` differ only in case: ordinal, as .NET's
/// `OrdinalIgnoreCase` compares property names.
fn same_but_case(a: &str, b: &str) -> bool {
    if a.is_ascii() && b.is_ascii() {
        return a.eq_ignore_ascii_case(b);
    }
    a.chars()
        .flat_map(char::to_lowercase)
        .eq(b.chars().flat_map(char::to_lowercase))
}

/// A deserializer whose structs take their fields' names in any case.
struct AnyCase<D>(D);

macro_rules! forward_wrapped {
    ($($method:ident)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
                self.0.$method(Wrap::new(visitor))
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for AnyCase<D> {
    type Error = D::Error;

    forward_wrapped! {
        deserialize_any deserialize_bool deserialize_i8 deserialize_i16 deserialize_i32
        deserialize_i64 deserialize_i128 deserialize_u8 deserialize_u16 deserialize_u32
        deserialize_u64 deserialize_u128 deserialize_f32 deserialize_f64 deserialize_char
        deserialize_str deserialize_string deserialize_bytes deserialize_byte_buf
        deserialize_option deserialize_unit deserialize_seq deserialize_map
        deserialize_identifier deserialize_ignored_any
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_unit_struct(name, Wrap::new(visitor))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_newtype_struct(name, Wrap::new(visitor))
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple(len, Wrap::new(visitor))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple_struct(name, len, Wrap::new(visitor))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let wrapped = Wrap {
            inner: visitor,
            fields: Some(fields),
        };
        self.0.deserialize_struct(name, fields, wrapped)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_enum(name, variants, Wrap::new(visitor))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

/// A visitor that hands what it visits on wrapped, and a struct's map its
/// field names.
struct Wrap<V> {
    inner: V,
    /// The fields of the struct being read, if it is one.
    fields: Option<&'static [&'static str]>,
}

impl<V> Wrap<V> {
    fn new(inner: V) -> Self {
        Self { inner, fields: None }
    }
}

macro_rules! forward_visits {
    ($($method:ident($ty:ty))*) => {
        $(
            fn $method<E: de::Error>(self, value: $ty) -> Result<V::Value, E> {
                self.inner.$method(value)
            }
        )*
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Wrap<V> {
    type Value = V::Value;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(formatter)
    }

    forward_visits! {
        visit_bool(bool) visit_i8(i8) visit_i16(i16) visit_i32(i32) visit_i64(i64) visit_i128(i128)
        visit_u8(u8) visit_u16(u16) visit_u32(u32) visit_u64(u64) visit_u128(u128)
        visit_f32(f32) visit_f64(f64) visit_char(char) visit_str(&str) visit_borrowed_str(&'de str)
        visit_string(String) visit_bytes(&[u8]) visit_borrowed_bytes(&'de [u8]) visit_byte_buf(Vec<u8>)
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        self.inner.visit_some(AnyCase(deserializer))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        self.inner.visit_newtype_struct(AnyCase(deserializer))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        // serde reads a struct from an array too, by position;
        // System.Text.Json reads an object only from an object, and fails
        // the message otherwise.
        if self.fields.is_some() {
            return Err(de::Error::invalid_type(de::Unexpected::Seq, &self.inner));
        }
        self.inner.visit_seq(Elements(seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(Entries {
            map,
            fields: self.fields,
        })
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.inner.visit_enum(Variant(data))
    }
}

/// A seed whose value is read wrapped.
struct Seed<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(AnyCase(deserializer))
    }
}

/// A sequence's elements, each read wrapped.
struct Elements<A>(A);

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Elements<A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, A::Error> {
        self.0.next_element_seed(Seed(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

/// A map's entries, each value read wrapped; a struct's keys matched to
/// its fields.
struct Entries<A> {
    map: A,
    fields: Option<&'static [&'static str]>,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Entries<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        match self.fields {
            Some(fields) => self.map.next_key_seed(FieldSeed { seed, fields }),
            // A dictionary: its keys are data, read as they are.
            None => self.map.next_key_seed(seed),
        }
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.map.next_value_seed(Seed(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.map.size_hint()
    }
}

/// An enum's variant, its content read wrapped (its name as it is).
struct Variant<A>(A);

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for Variant<A> {
    type Error = A::Error;
    type Variant = Content<A::Variant>;

    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Self::Variant), A::Error> {
        self.0
            .variant_seed(seed)
            .map(|(value, variant)| (value, Content(variant)))
    }
}

/// A variant's content, read wrapped.
struct Content<A>(A);

impl<'de, A: de::VariantAccess<'de>> de::VariantAccess<'de> for Content<A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.0.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.0.newtype_variant_seed(Seed(seed))
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.0.tuple_variant(len, Wrap::new(visitor))
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        let wrapped = Wrap {
            inner: visitor,
            fields: Some(fields),
        };
        self.0.struct_variant(fields, wrapped)
    }
}

/// A struct's key, read as the field it names in another case.
struct FieldSeed<S> {
    seed: S,
    fields: &'static [&'static str],
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for FieldSeed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.seed.deserialize(FieldName {
            key: deserializer,
            fields: self.fields,
        })
    }
}

/// A struct's key: whatever its reader asks, it is read as a string and
/// matched to the fields.
struct FieldName<D> {
    key: D,
    fields: &'static [&'static str],
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for FieldName<D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        self.key.deserialize_any(FieldVisitor {
            inner: visitor,
            fields: self.fields,
        })
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        self.key.deserialize_identifier(FieldVisitor {
            inner: visitor,
            fields: self.fields,
        })
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map struct enum ignored_any
    }
}

/// Visits a struct's key as the field it names.
struct FieldVisitor<V> {
    inner: V,
    fields: &'static [&'static str],
}

impl<'de, V: Visitor<'de>> Visitor<'de> for FieldVisitor<V> {
    type Value = V::Value;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(formatter)
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<V::Value, E> {
        self.inner.visit_str(field_named(key, self.fields).unwrap_or(key))
    }

    fn visit_borrowed_str<E: de::Error>(self, key: &'de str) -> Result<V::Value, E> {
        match field_named(key, self.fields) {
            Some(field) => self.inner.visit_borrowed_str(field),
            None => self.inner.visit_borrowed_str(key),
        }
    }

    fn visit_string<E: de::Error>(self, key: String) -> Result<V::Value, E> {
        match field_named(&key, self.fields) {
            Some(field) => self.inner.visit_borrowed_str(field),
            None => self.inner.visit_string(key),
        }
    }

    fn visit_bytes<E: de::Error>(self, key: &[u8]) -> Result<V::Value, E> {
        self.inner.visit_bytes(key)
    }

    fn visit_borrowed_bytes<E: de::Error>(self, key: &'de [u8]) -> Result<V::Value, E> {
        self.inner.visit_borrowed_bytes(key)
    }

    fn visit_u64<E: de::Error>(self, key: u64) -> Result<V::Value, E> {
        self.inner.visit_u64(key)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Default, PartialEq, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct CheckedIn {
        id: i64,
        attendee_id: i64,
        tags: BTreeMap<String, serde_json::Value>,
        note: String,
        badge: Option<Badge>,
        history: Vec<Badge>,
    }

    #[derive(Debug, Default, PartialEq, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    struct Badge {
        print_name: String,
    }

    #[test]
    fn fields_match_in_any_case_and_nothing_else_changes() {
        let body = br#"{"ID": 7, "AttendeeId": 42, "Tags": {"VIP": "yes", "EU": 1},
            "Note": "Keep THIS", "Badge": {"PrintName": "Ada"}, "HISTORY": [{"printNAME": "Bo"}],
            "Unknown": 1}"#;
        let read: CheckedIn = from_slice(body).unwrap();
        assert_eq!(
            read,
            CheckedIn {
                id: 7,
                attendee_id: 42,
                tags: BTreeMap::from([("VIP".into(), "yes".into()), ("EU".into(), 1.into())]),
                note: "Keep THIS".into(),
                badge: Some(Badge {
                    print_name: "Ada".into()
                }),
                history: vec![Badge {
                    print_name: "Bo".into()
                }],
            }
        );
    }

    #[test]
    fn the_camel_case_form_reads_as_serde_reads_it() {
        let body =
            br#"{"id": 1, "attendeeId": 2, "tags": {"a": null}, "note": "n", "badge": null, "history": []}"#;
        let any_case: CheckedIn = from_slice(body).unwrap();
        let exact: CheckedIn = serde_json::from_slice(body).unwrap();
        assert_eq!(any_case, exact);
    }

    #[test]
    fn a_key_that_names_no_field_is_not_bent_into_one() {
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Strict {
            #[serde(rename = "attendeeId")]
            _attendee_id: i64,
        }
        let error = from_slice::<Strict>(br#"{"attendeeId": 1, "attendee_id": 2}"#).unwrap_err();
        assert!(
            error.to_string().contains("unknown field `attendee_id`"),
            "{error}"
        );
        let error = from_slice::<Strict>(br#"{"x": 1} "#).unwrap_err();
        assert!(error.to_string().contains("unknown field `x`"), "{error}");
        // Trailing text after the value is refused, as serde_json does.
        assert!(from_slice::<Strict>(br#"{"attendeeId": 1} {}"#).is_err());
    }

    #[test]
    fn a_struct_is_read_from_an_object_only_as_system_text_json_reads_it() {
        let error = from_slice::<Badge>(br#"["Ada"]"#).unwrap_err();
        assert!(error.to_string().contains("invalid type: sequence"), "{error}");
        // A tuple, a vector, a tuple struct still read from arrays.
        let pair: (i64, String) = from_slice(br#"[1, "a"]"#).unwrap();
        assert_eq!(pair, (1, "a".to_owned()));
    }

    #[test]
    fn non_ascii_names_match_in_any_case() {
        #[derive(Debug, Deserialize)]
        struct Named {
            #[serde(rename = "größe")]
            size: i64,
        }
        let read: Named = from_slice("{\"GRÖßE\": 3}".as_bytes()).unwrap();
        assert_eq!(read.size, 3);
    }

    #[test]
    fn enums_and_newtypes_read_through() {
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(rename_all = "camelCase")]
        enum Seat {
            Aisle { row_number: u32 },
            Window(Wrapper),
        }
        #[derive(Debug, PartialEq, Deserialize)]
        struct Wrapper(Inner);
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Inner {
            row_number: u32,
        }
        let aisle: Seat = from_slice(br#"{"aisle": {"Row_Number": 3}}"#).unwrap();
        assert_eq!(aisle, Seat::Aisle { row_number: 3 });
        let window: Seat = from_slice(br#"{"window": {"ROWNUMBER": 4}}"#).unwrap();
        assert_eq!(window, Seat::Window(Wrapper(Inner { row_number: 4 })));
    }
}
