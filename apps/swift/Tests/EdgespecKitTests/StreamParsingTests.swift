import Foundation
import XCTest
@testable import EdgespecKit

/// Server-sent events as the server writes them (docs/server.md), parsed from bytes that
/// arrive split anywhere. No server needed.
final class StreamParsingTests: XCTestCase {
    static let base = #""id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1764410000, "model": "tiny-test""#
    static let stream = """
        data: {\(base), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]}

        : keep-alive

        data: {\(base), "choices": [{"index": 0, "delta": {"content": "Red"}, "logprobs": null, "finish_reason": null}]}

        : keep-alive

        data: {\(base), "choices": [{"index": 0, "delta": {"content": ", grün ✓"}, "logprobs": null, "finish_reason": null}]}

        data: {\(base), "choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"}], "edgespec": {"mode": "plain", "acceptance_rate": null, "tokens_per_pass": 1.0, "tokens_per_s": 41.0, "verifier_passes": 7, "drafted": 0, "accepted": 0, "draft_tokens": null, "prefill_s": 0.03, "decode_s": 0.17, "queue_s": 0.0, "notes": []}}

        data: {\(base), "choices": [], "usage": {"prompt_tokens": 25, "completion_tokens": 7, "total_tokens": 32}}

        data: [DONE]


        """

    /// Feeds `bytes` in pieces of `size` bytes.
    func decode(_ text: String, pieces size: Int) throws -> (chunks: [ChatCompletionChunk], comments: Int, done: Bool) {
        var decoder = SSEChunkDecoder<ChatCompletionChunk>()
        let bytes = Array(text.utf8)
        var chunks: [ChatCompletionChunk] = []
        var i = 0
        while i < bytes.count {
            chunks += decoder.feed(bytes[i..<min(i + size, bytes.count)])
            i += size
        }
        chunks += try decoder.finish()
        return (chunks, decoder.comments, decoder.done)
    }

    func testWholeStreamAnyPieceSize() throws {
        var reference: [ChatCompletionChunk]?
        for size in [1, 2, 3, 7, 64, 100_000] {  // 1 splits every UTF-8 sequence and every line end
            let (chunks, comments, done) = try decode(Self.stream, pieces: size)
            XCTAssertTrue(done)
            XCTAssertEqual(comments, 2, "keep-alive comments are seen and skipped")
            XCTAssertEqual(chunks.count, 5)
            XCTAssertEqual(chunks.map(\.text).joined(), "Red, grün ✓")
            XCTAssertEqual(chunks[0].choices[0].delta.role, .assistant)
            XCTAssertEqual(chunks[3].finishReason, .stop)
            XCTAssertEqual(chunks[3].edgespec?.mode, "plain")
            XCTAssertNil(chunks[3].edgespec?.acceptanceRate)
            XCTAssertEqual(chunks[3].edgespec?.verifierPasses, 7)
            XCTAssertEqual(chunks[4].usage, Usage(promptTokens: 25, completionTokens: 7, totalTokens: 32))
            XCTAssertTrue(chunks[4].choices.isEmpty)
            if let reference { XCTAssertEqual(chunks, reference) } else { reference = chunks }
        }
    }

    func testCRLFLineEnds() throws {
        let crlf = Self.stream.replacingOccurrences(of: "\n", with: "\r\n")
        for size in [1, 5, 100_000] {
            let (chunks, comments, done) = try decode(crlf, pieces: size)
            XCTAssertTrue(done)
            XCTAssertEqual(comments, 2)
            XCTAssertEqual(chunks.map(\.text).joined(), "Red, grün ✓")
        }
    }

    func testNothingAfterDoneIsRead() throws {
        let text = "data: [DONE]\n\ndata: {not json}\n\n"
        let (chunks, _, done) = try decode(text, pieces: 3)
        XCTAssertTrue(done)
        XCTAssertTrue(chunks.isEmpty)
    }

    func testErrorEventMidStreamThrows() throws {
        let lines = Self.stream.components(separatedBy: "\n\n")
        let failing = lines[0] + "\n\n" + lines[2] + "\n\n"
            + #"data: {"error": {"message": "generation failed: RuntimeError: boom", "type": "server_error", "param": null, "code": "generation_failed"}}"#
            + "\n\ndata: [DONE]\n\n"
        for size in [1, 9, 100_000] {
            var decoder = SSEChunkDecoder<ChatCompletionChunk>()
            var got: [ChatCompletionChunk] = []
            var thrown: Error?
            var i = 0
            let bytes = Array(failing.utf8)
            while i < bytes.count {
                got += decoder.feed(bytes[i..<min(i + size, bytes.count)])
                i += size
            }
            XCTAssertTrue(decoder.done, "nothing after the error is read")
            do {
                got += try decoder.finish()
            } catch {
                thrown = error
            }
            XCTAssertEqual(got.map(\.text).joined(), "Red", "chunks before the error are delivered")
            guard case .streamFailed(let body)? = thrown as? EdgespecError else {
                return XCTFail("expected streamFailed, got \(String(describing: thrown))")
            }
            XCTAssertEqual(body.code, "generation_failed")
            XCTAssertEqual(body.type, "server_error")
            XCTAssertTrue(body.message.contains("boom"))
        }
    }

    func testStreamWithoutDoneIsTruncated() throws {
        let cut = Self.stream.components(separatedBy: "data: [DONE]")[0]
        XCTAssertThrowsError(try decode(cut, pieces: 4)) { error in
            XCTAssertEqual(error as? EdgespecError, .streamTruncated)
        }
    }

    func testMalformedEventIsADecodingError() throws {
        XCTAssertThrowsError(try decode("data: {\"id\": 1}\n\n", pieces: 100)) { error in
            guard case .decoding? = error as? EdgespecError else { return XCTFail("\(error)") }
        }
    }

    func testParserFieldsAndMultilineData() {
        var parser = SSEParser()
        let events = parser.feed(Array("event: x\nid: 3\ndata:a\ndata: b\nretry: 10\n\n:c\n\ndata\n\n".utf8))
        XCTAssertEqual(events, [.data("a\nb"), .comment("c"), .data("")])
        XCTAssertEqual(parser.feed(Array("data: tail".utf8)), [])
        XCTAssertEqual(parser.finish(), [.data("tail")], "an unterminated last event is still delivered")
    }

    func testCompletionChunks() throws {
        let text = """
            data: {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [{"index": 0, "text": "ab", "logprobs": null, "finish_reason": null}]}

            data: {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "length"}], "edgespec": {"mode": "lookahead", "acceptance_rate": 0.5, "tokens_per_pass": 1.5, "tokens_per_s": 10.0, "verifier_passes": 2, "drafted": 4, "accepted": 2, "draft_tokens": 4, "prefill_s": 0.0, "decode_s": 0.1, "queue_s": 0.0, "notes": ["x"]}}

            data: [DONE]

            """
        var decoder = SSEChunkDecoder<CompletionChunk>()
        let chunks = try decoder.feed(Array(text.utf8)) + decoder.finish()
        XCTAssertEqual(chunks.map(\.text).joined(), "ab")
        XCTAssertEqual(chunks.last?.finishReason, .length)
        XCTAssertEqual(chunks.last?.edgespec?.acceptanceRate, 0.5)
        XCTAssertEqual(chunks.last?.edgespec?.draftTokens, 4)
        XCTAssertEqual(chunks.last?.edgespec?.notes, ["x"])
    }
}
