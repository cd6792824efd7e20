//! What the broker takes: AMQP's limits on names and on a message's
//! properties, checked before anything is published.
//!
//! A publish past one of them never reaches a queue, and fails in a way
//! that harms others: a name over 255 bytes panics in the client (`ShortString`
//! holds 255); properties (headers included) past the connection's
//! `frame_max` make RabbitMQ close the whole connection with FRAME_ERROR,
//! failing every other publish and ack in flight on it; a body past the
//! broker's `max_message_size` closes the channel. So every such message is
//! refused here, alone, with a reason that names the limit.

use lapin::BasicProperties;

/// The longest AMQP short string: exchange and queue names, routing keys,
/// the `type` and `message_id` properties, header keys.
pub(crate) const MAX_NAME_BYTES: usize = 255;

/// The most bytes a message's properties may take encoded (headers
/// included) when the runtime publishes it: half of RabbitMQ's default
/// `frame_max` (128 KiB), leaving room for a broker configured lower and
/// for the fault headers a move adds. The connection's own `frame_max` is
/// checked too, at each publish.
pub(crate) const MAX_PROPERTIES_BYTES: usize = 64 * 1024;

/// RabbitMQ's default `max_message_size` on 4.x (16 MiB): the default of
/// `message_bus.max_message_size`.
pub(crate) const DEFAULT_MAX_MESSAGE_SIZE: usize = 16 * 1024 * 1024;

/// A content header frame's bytes besides the properties: the frame's
/// header (type, channel, size: 7), class id and weight (4), body size
/// (8), and the frame end (1).
const CONTENT_HEADER_OVERHEAD: usize = 20;

/// Why `name` (what it is, for the reason) cannot be sent, if it cannot.
pub(crate) fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.len() <= MAX_NAME_BYTES {
        return Ok(());
    }
    Err(format!(
        "its {what} `{}…` is {} bytes; AMQP allows {MAX_NAME_BYTES}",
        crate::fault::truncate(name, 64),
        name.len()
    ))
}

/// The bytes `properties` take encoded in a content header frame, as the
/// client writes them. Every name in them must be a valid short string
/// (they are, once built: `ShortString` refuses longer ones).
pub(crate) fn encoded_size(properties: &BasicProperties) -> usize {
    let encoded = cookie_factory::r#gen(lapin::protocol::basic::gen_properties(properties), Vec::new());
    // Writing to a Vec fails only on a value the encoding cannot hold: a
    // table past 4 GiB, which no frame carries anyway.
    encoded.map_or(usize::MAX, |(bytes, _)| bytes.len())
}

/// Why a message with `properties` cannot go out on a connection whose
/// negotiated frame size is `frame_max` (0: no limit), if it cannot:
/// encoded, they must fit [`MAX_PROPERTIES_BYTES`] and one frame.
pub(crate) fn check_properties(properties: &BasicProperties, frame_max: u32) -> Result<(), String> {
    let size = encoded_size(properties);
    let frame_room = match frame_max {
        0 => usize::MAX,
        max => (max as usize).saturating_sub(CONTENT_HEADER_OVERHEAD),
    };
    let limit = MAX_PROPERTIES_BYTES.min(frame_room);
    if size <= limit {
        return Ok(());
    }
    Err(format!(
        "its properties and headers take {size} bytes encoded; at most {limit} go out (one AMQP frame, \
         frame_max {frame_max})"
    ))
}

/// Why a body of `size` bytes cannot go out under
/// `message_bus.max_message_size` = `max`, if it cannot.
pub(crate) fn check_body(size: usize, max: usize) -> Result<(), String> {
    if size <= max {
        return Ok(());
    }
    Err(format!(
        "its body is {size} bytes; the broker takes at most {max} (message_bus.max_message_size)"
    ))
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable};

    use super::*;

    fn with_headers(entries: usize, value: &str) -> BasicProperties {
        let mut table = FieldTable::default();
        for i in 0..entries {
            table.insert(format!("k{i}").into(), AMQPValue::LongString(value.into()));
        }
        BasicProperties::default().with_headers(table)
    }

    #[test]
    fn the_encoded_size_counts_each_entrys_framing_not_only_its_bytes() {
        // Flags (2), the table's length (4), and per entry: key length (1),
        // key, type tag (1), value length (4), value.
        assert_eq!(encoded_size(&BasicProperties::default()), 2);
        assert_eq!(encoded_size(&with_headers(1, "")), 2 + 4 + 1 + 2 + 1 + 4);
        // 12,000 empty values: their keys and values are under 60 KB, the
        // frame is over 120 KB.
        let many = with_headers(12_000, "");
        assert!(encoded_size(&many) > 120_000, "{}", encoded_size(&many));
        assert!(check_properties(&many, 131_072).is_err());
    }

    #[test]
    fn properties_must_fit_both_the_runtimes_bound_and_the_connections_frame() {
        let small = with_headers(1, &"x".repeat(10_000));
        assert!(check_properties(&small, 131_072).is_ok());
        assert!(check_properties(&small, 0).is_ok());
        let refused = check_properties(&small, 8_192).unwrap_err();
        assert!(refused.contains("frame_max 8192"), "{refused}");
        assert!(check_properties(&with_headers(1, &"x".repeat(70_000)), 0).is_err());
    }

    #[test]
    fn names_past_255_bytes_and_bodies_past_the_setting_are_refused_with_the_limit() {
        assert!(check_name("routing key", &"q".repeat(255)).is_ok());
        let refused = check_name("header key", &"k".repeat(256)).unwrap_err();
        assert!(
            refused.contains("header key") && refused.contains("256 bytes"),
            "{refused}"
        );
        assert!(check_body(10, 10).is_ok());
        let refused = check_body(11, 10).unwrap_err();
        assert!(refused.contains("message_bus.max_message_size"), "{refused}");
    }
}
