import Foundation

/// An incremental parser of server-sent events (the `text/event-stream` format): feed it
/// bytes as they arrive, split anywhere, and it returns each complete event. Lines end
/// with LF or CRLF; `data:` lines of one event are joined with newlines; an event ends at
/// a blank line; lines starting with `:` are comments (the server's `: keep-alive`).
public struct SSEParser: Sendable {
    public enum Event: Sendable, Equatable {
        case data(String)
        case comment(String)
    }

    private var line: [UInt8] = []
    private var dataLines: [String] = []

    public init() {}

    public mutating func feed<Bytes: Sequence>(_ bytes: Bytes) -> [Event] where Bytes.Element == UInt8 {
        var events: [Event] = []
        for byte in bytes {
            if byte == UInt8(ascii: "\n") {
                if line.last == UInt8(ascii: "\r") { line.removeLast() }
                if let event = takeLine() { events.append(event) }
                line.removeAll(keepingCapacity: true)
            } else {
                line.append(byte)
            }
        }
        return events
    }

    /// At the end of the stream: an event whose blank line never came is still delivered.
    public mutating func finish() -> [Event] {
        var events: [Event] = []
        if !line.isEmpty {
            if line.last == UInt8(ascii: "\r") { line.removeLast() }
            if let event = takeLine() { events.append(event) }
            line.removeAll()
        }
        if !dataLines.isEmpty {
            events.append(.data(dataLines.joined(separator: "\n")))
            dataLines.removeAll()
        }
        return events
    }

    private mutating func takeLine() -> Event? {
        if line.isEmpty {  // end of an event
            guard !dataLines.isEmpty else { return nil }
            defer { dataLines.removeAll() }
            return .data(dataLines.joined(separator: "\n"))
        }
        let text = String(decoding: line, as: UTF8.self)
        if text.hasPrefix(":") {
            return .comment(Self.value(text.dropFirst()))
        }
        let field: Substring
        let value: String
        if let colon = text.firstIndex(of: ":") {
            field = text[..<colon]
            value = Self.value(text[text.index(after: colon)...])
        } else {
            field = Substring(text)
            value = ""
        }
        if field == "data" { dataLines.append(value) }
        // `event`, `id` and `retry` are not used by edgespec and are ignored.
        return nil
    }

    private static func value(_ s: Substring) -> String {
        String(s.hasPrefix(" ") ? s.dropFirst() : s)
    }
}

/// Turns the bytes of an edgespec stream into chunks: JSON `data:` events decode to
/// `Chunk`, `data: [DONE]` ends the stream, an `{"error": ...}` event throws
/// `EdgespecError.streamFailed`, comments are counted and skipped.
struct SSEChunkDecoder<Chunk: Decodable> {
    private var parser = SSEParser()
    private let decoder = JSONDecoder()
    /// `[DONE]` or an error came: read no further.
    private(set) var done = false
    private(set) var comments = 0
    /// An error event, or an event that does not decode: thrown by `finish()`, after the
    /// chunks that came before it were returned.
    private(set) var failure: EdgespecError?

    mutating func feed<Bytes: Sequence>(_ bytes: Bytes) -> [Chunk] where Bytes.Element == UInt8 {
        guard !done else { return [] }
        return handle(parser.feed(bytes))
    }

    /// Call when the stream ends (or `done` is set): returns what is left, throws the
    /// failure if there was one, and `streamTruncated` if `[DONE]` never came.
    mutating func finish() throws -> [Chunk] {
        let chunks = done ? [] : handle(parser.finish())
        if let failure { throw failure }
        guard done else { throw EdgespecError.streamTruncated }
        return chunks
    }

    private mutating func handle(_ events: [SSEParser.Event]) -> [Chunk] {
        var chunks: [Chunk] = []
        for event in events {
            switch event {
            case .comment:
                comments += 1
            case .data(let payload):
                if payload == "[DONE]" {
                    done = true
                    return chunks
                }
                let data = Data(payload.utf8)
                if let envelope = try? decoder.decode(ErrorEnvelope.self, from: data) {
                    failure = .streamFailed(envelope.error)
                    done = true
                    return chunks
                }
                do {
                    chunks.append(try decoder.decode(Chunk.self, from: data))
                } catch {
                    failure = .decoding("stream event \(payload.prefix(200)): \(error)")
                    done = true
                    return chunks
                }
            }
        }
        return chunks
    }
}
