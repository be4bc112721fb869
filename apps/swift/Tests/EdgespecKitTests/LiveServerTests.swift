import Foundation
import XCTest
@testable import EdgespecKit

/// Against a real `edgespec serve` (tiny random bundle from tests/swift_fixture.py, started
/// by `EdgespecServer`), compared with the Python API's replies in reference.json.
final class LiveServerTests: XCTestCase {
    static let key = "sk-swift-test"

    var reference: Fixture.Reference!
    var server: EdgespecServer!
    var client: EdgespecClient!

    override func setUp() async throws {
        reference = try Fixture.reference()
        server = try await Fixture.sharedServer("main", apiKey: Self.key)
        client = try server.client(retryPolicy: .none, timeout: 120)
    }

    var messages: [ChatMessage] { reference.messages }

    // MARK: Endpoints

    func testHealthAndModels() async throws {
        let health = try await client.health()
        XCTAssertEqual(health.status, "ok")
        XCTAssertEqual(health.model, reference.model_id)
        XCTAssertTrue(health.modes.contains("auto") && health.modes.contains("plain"), "\(health.modes)")
        let ids = try await client.models().map(\.id)
        XCTAssertEqual(ids, [reference.model_id, "default"])
        let card = try await client.model("default")
        XCTAssertEqual(card.ownedBy, "edgespec")
        // /health needs no token.
        let anonymous = EdgespecClient(baseURL: client.baseURL, retryPolicy: .none)
        let open = try await anonymous.health()
        XCTAssertEqual(open.status, "ok")
    }

    // MARK: Greedy equality with the Python API

    func testStreamedChatEqualsThePythonAPI() async throws {
        let request = ChatRequest(messages: messages, options: .init(maxTokens: reference.chat.max_tokens))
        var chunks: [ChatCompletionChunk] = []
        for try await chunk in client.streamChat(request) {
            chunks.append(chunk)
        }
        let text = chunks.map(\.text).joined()
        XCTAssertEqual(text, reference.chat.text)
        XCTAssertFalse(text.isEmpty)
        XCTAssertEqual(chunks.first?.choices.first?.delta.role, .assistant, "the role chunk comes first")
        XCTAssertGreaterThan(chunks.filter { !$0.text.isEmpty }.count, 1, "text arrives in pieces")
        let finals = chunks.filter { $0.finishReason != nil }
        XCTAssertEqual(finals.count, 1)
        XCTAssertEqual(finals.first?.finishReason?.rawValue, reference.chat.finish_reason == "length" ? "length" : "stop")
        let stats = try XCTUnwrap(finals.first?.edgespec)
        XCTAssertGreaterThanOrEqual(stats.verifierPasses ?? 0, 1)
        XCTAssertGreaterThan(stats.tokensPerPass ?? 0, 0)
        XCTAssertNotNil(stats.queueS)
        let usage = try XCTUnwrap(chunks.last?.usage, "the usage chunk comes last")
        XCTAssertEqual(usage.promptTokens, reference.chat.prompt_tokens)
        XCTAssertEqual(usage.completionTokens, reference.chat.completion_tokens)
        XCTAssertEqual(chunks.last?.model, reference.model_id)

        // The same request, not streamed: the same reply.
        let whole = try await client.chat(request)
        XCTAssertEqual(whole.text, reference.chat.text)
        XCTAssertEqual(whole.model, reference.model_id)
        XCTAssertEqual(whole.usage?.completionTokens, reference.chat.completion_tokens)
        XCTAssertNotNil(whole.edgespec?.mode)
    }

    func testCompletionsEqualThePythonAPI() async throws {
        let c = reference.completion
        let options = GenerationOptions(maxTokens: c.max_tokens)
        let whole = try await client.complete(CompletionRequest(prompt: c.prompt, options: options))
        XCTAssertEqual(whole.text, c.text)
        XCTAssertEqual(whole.object, "text_completion")
        XCTAssertEqual(whole.usage, Usage(promptTokens: c.prompt_tokens, completionTokens: c.max_tokens,
                                          totalTokens: c.prompt_tokens + c.max_tokens))
        var streamed = ""
        var last: CompletionChunk?
        for try await chunk in client.streamCompletion(CompletionRequest(prompt: c.prompt, options: options)) {
            streamed += chunk.text
            last = chunk
        }
        XCTAssertEqual(streamed, c.text)
        XCTAssertEqual(last?.usage?.completionTokens, c.max_tokens)
        let ids = try await client.complete(CompletionRequest(prompt: .tokens(c.prompt_ids), options: options))
        XCTAssertEqual(ids.text, c.text, "a prompt of token ids")
    }

    func testEveryModeWithoutADrafterGivesTheGreedyReply() async throws {
        let health = try await client.health()
        for mode in ["auto", "plain", "lookahead", "prompt_lookup"] where health.modes.contains(mode) {
            let options = GenerationOptions(maxTokens: reference.chat.max_tokens, temperature: 0,
                                            mode: DecodingMode(rawValue: mode))
            var text = ""
            var stats: EdgespecStats?
            for try await chunk in client.streamChat(ChatRequest(messages: messages, options: options)) {
                text += chunk.text
                stats = chunk.edgespec ?? stats
            }
            XCTAssertEqual(text, reference.chat.text, mode)
            XCTAssertNotNil(stats, mode)
        }
        let lookahead = GenerationOptions(maxTokens: reference.chat.max_tokens, mode: .lookahead, draftTokens: .auto,
                                          modeOptions: ["window": 3, "ngram": 3])
        let reply = try await client.chat(ChatRequest(messages: messages, options: lookahead))
        XCTAssertEqual(reply.text, reference.chat.text)
        XCTAssertEqual(reply.edgespec?.mode, "lookahead")
    }

    func testSamplingOptionsAndStop() async throws {
        let s = reference.seeded
        let options = GenerationOptions(maxTokens: s.max_tokens, temperature: s.temperature, topP: s.top_p, seed: s.seed)
        var streamed = ""
        for try await chunk in client.streamChat(ChatRequest(messages: messages, options: options)) {
            streamed += chunk.text
        }
        XCTAssertEqual(streamed, s.text, "seeded sampling equals the Python API's")
        let whole = try await client.chat(ChatRequest(messages: messages, options: options))
        XCTAssertEqual(whole.text, s.text)

        let extras = GenerationOptions(maxTokens: 8, temperature: 0.8, topK: 5, minP: 0.05, seed: 7, mode: .plain,
                                       draftTokens: .fixed(4))
        let a = try await client.chat(ChatRequest(messages: messages, options: extras))
        let b = try await client.chat(ChatRequest(messages: messages, options: extras))
        XCTAssertEqual(a.text, b.text, "top_k, min_p, seed accepted and repeatable")
        XCTAssertEqual(a.edgespec?.mode, "plain")

        let stop = GenerationOptions(maxTokens: reference.stop.max_tokens, stop: [reference.stop.stop, "@@"])
        let stopped = try await client.chat(ChatRequest(messages: messages, options: stop))
        XCTAssertEqual(stopped.text, reference.stop.text)
        XCTAssertEqual(stopped.finishReason, .stop)
    }

    // MARK: Cancellation

    func testCancellingMidStreamFreesTheServer() async throws {
        // Tried a few times: the tiny model can finish its 480 tokens before the cancelled
        // connection reaches the server (then counted as completed); one try must be cancelled.
        var cancelled = false
        for _ in 0..<5 where !cancelled {
            let before = try await client.health().queue
            let request = CompletionRequest(prompt: reference.completion.prompt, options: .init(maxTokens: 480))
            let stream = client.streamCompletion(request)
            let (started, startedSignal) = AsyncStream<Void>.makeStream()
            let consumer = Task {
                defer { startedSignal.finish() }  // never leave the test waiting if the stream fails early
                var pieces = 0
                for try await chunk in stream where !chunk.text.isEmpty {
                    pieces += 1
                    if pieces == 1 { startedSignal.yield() }
                }
                return pieces
            }
            for await _ in started { break }  // the generation is under way
            consumer.cancel()
            let result = await consumer.result
            if case .success(let pieces) = result {
                XCTAssertLessThan(pieces, 480, "the stream ended early")
            }
            cancelled = try await endedCancelled(since: before)
        }
        XCTAssertTrue(cancelled, "cancelling the stream never cancelled the generation")
        // The next request is served at once, and correctly.
        let c = reference.completion
        let next = try await client.complete(CompletionRequest(prompt: c.prompt, options: .init(maxTokens: c.max_tokens)))
        XCTAssertEqual(next.text, c.text)
    }

    /// Waits until the one generation started after `before` has ended and the server is idle;
    /// true if it was counted as cancelled (false: it completed first).
    private func endedCancelled(since before: Health.Queue) async throws -> Bool {
        var after = before
        try await eventually("the server has ended the generation and is idle") {
            after = try await client.health().queue
            return after.cancelled + after.completed == before.cancelled + before.completed + 1 && after.running == 0
        }
        return after.cancelled == before.cancelled + 1
    }

    func testBreakingOutOfTheLoopAlsoCancels() async throws {
        // The tiny model can write its 400 tokens before the closed connection reaches the
        // server, which then counts the reply as completed: tried a few times, and at least
        // one abandoned generation must be counted as cancelled.
        var cancelled = false
        for _ in 0..<5 where !cancelled {
            let before = try await client.health().queue
            let request = ChatRequest(messages: messages, options: .init(maxTokens: 400))
            var seen = 0
            for try await chunk in client.streamChat(request) where !chunk.text.isEmpty {
                seen += 1
                break
            }
            XCTAssertEqual(seen, 1)
            cancelled = try await endedCancelled(since: before)
        }
        XCTAssertTrue(cancelled, "breaking out of the loop never cancelled the generation")
    }

    // MARK: Errors

    func testBadRequestNamesTheField() async throws {
        let cases: [(GenerationOptions, String)] = [
            (.init(temperature: -0.5), "temperature"),
            (.init(topP: 0), "top_p"),
            (.init(maxTokens: 0), "max_tokens"),
            (.init(mode: "warp"), "mode"),
            (.init(draftTokens: .fixed(17)), "draft_tokens"),
            (.init(stop: ["a", "b", "c", "d", "e"]), "stop"),
        ]
        for (options, field) in cases {
            for stream in [false, true] {
                let request = ChatRequest(messages: messages, options: options)
                let error = await caught {
                    if stream {
                        for try await _ in client.streamChat(request) {}
                    } else {
                        _ = try await client.chat(request)
                    }
                }
                guard case .badRequest(let body)? = error as? EdgespecError else {
                    XCTFail("\(field) stream=\(stream): expected badRequest, got \(String(describing: error))")
                    continue
                }
                XCTAssertEqual(body.param, field)
                XCTAssertEqual(body.code, "invalid_value")
                XCTAssertEqual(body.type, "invalid_request_error")
            }
        }
        let options = GenerationOptions(mode: .lookahead, modeOptions: ["window": 999])
        let error = await caught { try await client.chat(ChatRequest(messages: messages, options: options)) }
        XCTAssertEqual((error as? EdgespecError)?.code, "invalid_value")
        XCTAssertTrue(((error as? EdgespecError)?.serverError?.message ?? "").contains("window"))
        // The server keeps serving.
        let after = try await client.chat(ChatRequest(messages: messages, options: .init(maxTokens: 2)))
        XCTAssertEqual(after.usage?.completionTokens, 2)
    }

    func testNotFoundAndTooLarge() async throws {
        let unknown = await caught {
            try await client.chat(ChatRequest(model: "gpt-4o", messages: messages, options: .init(maxTokens: 2)))
        }
        guard case .notFound(let body)? = unknown as? EdgespecError else { return XCTFail("\(String(describing: unknown))") }
        XCTAssertEqual(body.code, "model_not_found")
        XCTAssertEqual(body.param, "model")

        let huge = String(repeating: "a", count: 5 << 20)
        let tooLarge = await caught { try await client.complete(CompletionRequest(prompt: huge)) }
        guard case .payloadTooLarge(let e)? = tooLarge as? EdgespecError else {
            return XCTFail("\(String(describing: tooLarge))")
        }
        XCTAssertEqual(e.code, "body_too_large")
        let after = try await client.complete(CompletionRequest(prompt: "abc", options: .init(maxTokens: 2)))
        XCTAssertEqual(after.usage?.completionTokens, 2)
    }

    func testBearerToken() async throws {
        for key in [nil, "wrong"] as [String?] {
            let other = EdgespecClient(baseURL: client.baseURL, apiKey: key, retryPolicy: .none)
            let error = await caught { try await other.models() }
            guard case .unauthorized(let body)? = error as? EdgespecError else {
                XCTFail("key \(String(describing: key)): \(String(describing: error))")
                continue
            }
            XCTAssertEqual(body.code, "invalid_api_key")
            let streamError = await caught {
                for try await _ in other.streamChat(ChatRequest(messages: self.messages)) {}
            }
            XCTAssertEqual((streamError as? EdgespecError)?.status, 401)
        }
        let models = try await client.models()
        XCTAssertEqual(models.count, 2, "with the right key")
    }

    func testUnreachableServerIsAConnectionError() async throws {
        // The server's own port, once it is stopped, is covered in ProcessManagerTests; here
        // a port nothing listens on (port 9 is discard, closed on test machines).
        let nowhere = EdgespecClient(baseURL: URL(string: "http://127.0.0.1:9")!, retryPolicy: .none, timeout: 10)
        let error = await caught { try await nowhere.health() }
        guard case .connection? = error as? EdgespecError else { return XCTFail("\(String(describing: error))") }
    }
}
