import Foundation
import XCTest
@testable import EdgespecKit

/// Request bodies, response decoding, error mapping and the retry policy. No server needed.
final class CodingTests: XCTestCase {
    func json(_ value: some Encodable) throws -> [String: Any] {
        let data = try JSONEncoder().encode(value)
        return try XCTUnwrap(JSONSerialization.jsonObject(with: data) as? [String: Any])
    }

    func testModelListWithStoredModels() throws {
        let raw = """
        {"object": "list", "data": [
          {"id": "tiny", "object": "model", "created": 1, "owned_by": "edgespec"},
          {"id": "default", "object": "model", "created": 1, "owned_by": "edgespec"},
          {"id": "Qwen/Qwen3-0.6B", "object": "model", "created": 1, "owned_by": "edgespec", "stored": true}]}
        """
        let list = try JSONDecoder().decode(ModelList.self, from: Data(raw.utf8))
        XCTAssertEqual(list.data.map(\.id), ["tiny", "default", "Qwen/Qwen3-0.6B"])
        XCTAssertEqual(list.data.filter(\.isStored).map(\.id), ["Qwen/Qwen3-0.6B"])
        XCTAssertNil(list.data[0].stored)
    }

    func testChatRequestWithEveryOption() throws {
        var request = ChatRequest(
            model: "default", messages: [.system("You are brief."), .user("Name three colours.")],
            options: GenerationOptions(maxTokens: 64, temperature: 0.7, topP: 0.9, topK: 40, minP: 0.05,
                                       seed: 18_446_744_073_709_551_615, stop: ["\n\n", "END"], mode: .lookahead,
                                       draftTokens: .fixed(4),
                                       modeOptions: ["window": 5, "ngram": 3, "adaptive": true, "sources": "context+history"]))
        var body = try json(request)
        XCTAssertEqual(Set(body.keys), ["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                                        "seed", "stop", "mode", "draft_tokens", "mode_options", "stream"])
        XCTAssertEqual(body["stream"] as? Bool, false)
        XCTAssertEqual(body["max_tokens"] as? Int, 64)
        XCTAssertEqual(body["temperature"] as? Double, 0.7)
        XCTAssertEqual(body["top_p"] as? Double, 0.9)
        XCTAssertEqual(body["top_k"] as? Int, 40)
        XCTAssertEqual(body["min_p"] as? Double, 0.05)
        XCTAssertEqual(body["stop"] as? [String], ["\n\n", "END"])
        XCTAssertEqual(body["mode"] as? String, "lookahead")
        XCTAssertEqual(body["draft_tokens"] as? Int, 4)
        let options = try XCTUnwrap(body["mode_options"] as? [String: Any])
        XCTAssertEqual(options["window"] as? Int, 5)
        XCTAssertEqual(options["adaptive"] as? Bool, true)
        XCTAssertEqual(options["sources"] as? String, "context+history")
        let raw = String(decoding: try JSONEncoder().encode(request), as: UTF8.self)
        XCTAssertTrue(raw.contains("\"seed\":18446744073709551615"), raw)
        let messages = try XCTUnwrap(body["messages"] as? [[String: String]])
        XCTAssertEqual(messages, [["role": "system", "content": "You are brief."],
                                  ["role": "user", "content": "Name three colours."]])

        request.stream = true
        body = try json(request)
        XCTAssertEqual(body["stream"] as? Bool, true)
        XCTAssertEqual(body["stream_options"] as? [String: Bool], ["include_usage": true])
        request.includeUsage = false
        XCTAssertNil(try json(request)["stream_options"])
    }

    func testStructuredRequestBodiesKeepTheSchemasKeyOrder() throws {
        let schema: JSONValue = ["type": "object", "properties": ["zeta": ["type": "string"], "alpha": ["type": "integer"],
                                                                  "mid": ["enum": ["b", "a"]]],
                                 "required": ["zeta", "alpha"]]
        let request = ChatRequest(messages: [.user("hi"), .tool("{\"ok\": true}", callId: "call_1")],
                                  options: .init(presencePenalty: 0.5, repetitionPenalty: 1.2),
                                  responseFormat: .jsonSchema(name: "T", schema: schema),
                                  tools: [Tool(name: "f", description: "does f", parameters: schema)],
                                  toolChoice: .function("f"), parallelToolCalls: false)
        let data = try request.jsonBody()
        let raw = String(decoding: data, as: UTF8.self)
        // Property order as written, in the response format and in the tool's parameters.
        XCTAssertTrue(raw.contains(#""properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"},"mid":{"enum":["b","a"]}}"#),
                      raw)
        let body = try XCTUnwrap(JSONSerialization.jsonObject(with: data) as? [String: Any])
        XCTAssertEqual(body["parallel_tool_calls"] as? Bool, false)
        XCTAssertEqual(body["presence_penalty"] as? Double, 0.5)
        XCTAssertEqual(body["repetition_penalty"] as? Double, 1.2)
        let format = try XCTUnwrap(body["response_format"] as? [String: Any])
        XCTAssertEqual(format["type"] as? String, "json_schema")
        XCTAssertEqual((format["json_schema"] as? [String: Any])?["name"] as? String, "T")
        let tool = try XCTUnwrap((body["tools"] as? [[String: Any]])?.first)
        XCTAssertEqual(tool["type"] as? String, "function")
        XCTAssertEqual((tool["function"] as? [String: Any])?["description"] as? String, "does f")
        let choice = try XCTUnwrap(body["tool_choice"] as? [String: Any])
        XCTAssertEqual(choice["type"] as? String, "function")
        XCTAssertEqual((choice["function"] as? [String: String])?["name"], "f")
        let messages = try XCTUnwrap(body["messages"] as? [[String: String]])
        XCTAssertEqual(messages.last, ["role": "tool", "content": "{\"ok\": true}", "tool_call_id": "call_1"])
        // The same body through JSONEncoder holds the same values (in whatever key order).
        XCTAssertEqual(try JSONValue(json: raw), try JSONDecoder().decode(JSONValue.self, from: JSONEncoder().encode(request)))
    }

    func testToolCallDeltasAndRepliesDecode() throws {
        let lines = [
            #"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"get_time","arguments":""}}]},"logprobs":null,"finish_reason":null}]}"#,
            #"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"zone\": "}}]},"logprobs":null,"finish_reason":null}]}"#,
            #"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"UTC\"}"}}]},"logprobs":null,"finish_reason":"tool_calls"}]}"#,
        ]
        var calls = ToolCallAccumulator()
        var finish: FinishReason?
        for line in lines {
            let chunk = try JSONDecoder().decode(ChatCompletionChunk.self, from: Data(line.utf8))
            calls.add(chunk)
            finish = chunk.finishReason ?? finish
        }
        XCTAssertEqual(finish, .toolCalls)
        XCTAssertEqual(calls.toolCalls, [ToolCall(id: "call_a", name: "get_time", arguments: #"{"zone": "UTC"}"#)])
        struct Zone: Decodable, Equatable { let zone: String }
        XCTAssertEqual(try calls.toolCalls[0].decodeArguments(Zone.self), Zone(zone: "UTC"))

        let whole = #"{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_b","type":"function","function":{"name":"f","arguments":"{}"}}]},"logprobs":null,"finish_reason":"tool_calls"}]}"#
        let reply = try JSONDecoder().decode(ChatCompletion.self, from: Data(whole.utf8))
        XCTAssertEqual(reply.text, "")
        XCTAssertEqual(reply.toolCalls.map(\.function.name), ["f"])
        XCTAssertThrowsError(try reply.decode(Zone.self))
    }

    func testUnsetOptionsAreLeftOut() throws {
        let body = try json(ChatRequest(messages: [.user("hi")]))
        XCTAssertEqual(Set(body.keys), ["model", "messages", "stream"], "unknown or null fields would be rejected")
        XCTAssertEqual(body["model"] as? String, "default")
        var auto = GenerationOptions()
        auto.draftTokens = .auto
        auto.mode = .promptLookup
        let completion = try json(CompletionRequest(prompt: .tokens([1, 2, 3]), options: auto))
        XCTAssertEqual(completion["draft_tokens"] as? String, "auto")
        XCTAssertEqual(completion["mode"] as? String, "prompt_lookup")
        XCTAssertEqual(completion["prompt"] as? [Int], [1, 2, 3])
        XCTAssertEqual(try json(CompletionRequest(prompt: "abc"))["prompt"] as? String, "abc")
    }

    func testDecodesTheDocumentedReply() throws {
        let text = """
            {"id": "chatcmpl-56a3", "object": "chat.completion", "created": 1764410000, "model": "SmolLM2-135M-Instruct-f32",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "Red, green and blue."}, "logprobs": null, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 25, "completion_tokens": 7, "total_tokens": 32},
             "edgespec": {"mode": "speculative", "acceptance_rate": 0.71, "tokens_per_pass": 2.4, "tokens_per_s": 48.2,
                          "verifier_passes": 3, "drafted": 12, "accepted": 8, "draft_tokens": 4, "prefill_s": 0.031,
                          "decode_s": 0.145, "queue_s": 0.0004, "notes": []}}
            """
        let reply = try JSONDecoder().decode(ChatCompletion.self, from: Data(text.utf8))
        XCTAssertEqual(reply.text, "Red, green and blue.")
        XCTAssertEqual(reply.finishReason, .stop)
        XCTAssertEqual(reply.choices[0].message.role, .assistant)
        XCTAssertEqual(reply.usage?.totalTokens, 32)
        XCTAssertEqual(reply.edgespec?.acceptanceRate, 0.71)
        XCTAssertEqual(reply.edgespec?.draftTokens, 4)
        XCTAssertEqual(reply.edgespec?.queueS, 0.0004)

        let health = """
            {"status": "ok", "model": "m", "modes": ["auto", "plain"],
             "queue": {"running": 0, "waiting": 0, "max_waiting": 16, "submitted": 12, "completed": 10, "cancelled": 2, "refused": 0, "failed": 0},
             "history": {"mode": "off"}}
            """
        let h = try JSONDecoder().decode(Health.self, from: Data(health.utf8))
        XCTAssertEqual(h.queue.maxWaiting, 16)
        XCTAssertEqual(h.history?.mode, "off")
        XCTAssertNil(h.history?.documents)
    }

    func body(_ code: String?, param: String? = nil, type: String = "invalid_request_error") -> Data {
        let e = ErrorEnvelope(error: ServerError(message: "m", type: type, param: param, code: code))
        return try! JSONEncoder().encode(e)
    }

    func testErrorMapping() {
        let bad = EdgespecError.from(status: 400, body: body("invalid_value", param: "temperature"))
        XCTAssertEqual(bad, .badRequest(ServerError(message: "m", type: "invalid_request_error", param: "temperature",
                                                    code: "invalid_value")))
        XCTAssertEqual(bad.param, "temperature")
        XCTAssertEqual(bad.status, 400)
        guard case .unauthorized = EdgespecError.from(status: 401, body: body("invalid_api_key")) else { return XCTFail() }
        guard case .notFound = EdgespecError.from(status: 404, body: body("model_not_found", param: "model")) else {
            return XCTFail()
        }
        guard case .payloadTooLarge = EdgespecError.from(status: 413, body: body("body_too_large")) else { return XCTFail() }
        let full = EdgespecError.from(status: 503, body: body("queue_full", type: "server_error"), retryAfter: "1")
        guard case .queueFull(let e, let retryAfter) = full else { return XCTFail("\(full)") }
        XCTAssertEqual(e.code, "queue_full")
        XCTAssertEqual(retryAfter, 1)
        guard case .queueFull(_, nil) = EdgespecError.from(status: 503, body: body("queue_full"),
                                                           retryAfter: "Wed, 21 Oct 2015 07:28:00 GMT")
        else { return XCTFail() }
        guard case .server(500, let e500) = EdgespecError.from(status: 500, body: body("generation_failed")) else {
            return XCTFail()
        }
        XCTAssertEqual(e500.code, "generation_failed")
        guard case .server(503, _) = EdgespecError.from(status: 503, body: body(nil)) else { return XCTFail() }
        XCTAssertEqual(EdgespecError.from(status: 502, body: Data("Bad Gateway".utf8)),
                       .unexpectedResponse(status: 502, body: "Bad Gateway"))
        XCTAssertNotNil(full.localizedDescription.range(of: "queue_full"))
    }

    func testRetryPolicy() {
        let full = EdgespecError.queueFull(ServerError(message: "busy", type: "server_error", code: "queue_full"),
                                           retryAfter: 1)
        let policy = RetryPolicy(maxRetries: 2, defaultDelay: 0.5, maxDelay: 10)
        XCTAssertEqual(policy.delay(beforeRetry: 1, after: full), 1, "Retry-After is honoured")
        XCTAssertEqual(policy.delay(beforeRetry: 2, after: full), 1)
        XCTAssertNil(policy.delay(beforeRetry: 3, after: full), "bounded")
        let noHeader = EdgespecError.queueFull(ServerError(message: "busy", type: "server_error"), retryAfter: nil)
        XCTAssertEqual(policy.delay(beforeRetry: 1, after: noHeader), 0.5)
        let long = EdgespecError.queueFull(ServerError(message: "busy", type: "server_error"), retryAfter: 3600)
        XCTAssertEqual(policy.delay(beforeRetry: 1, after: long), 10, "capped")
        XCTAssertNil(RetryPolicy.none.delay(beforeRetry: 1, after: full))
        let other = EdgespecError.badRequest(ServerError(message: "no", type: "invalid_request_error"))
        XCTAssertNil(policy.delay(beforeRetry: 1, after: other), "only queue_full is retried")
    }

    func testBaseURLForms() {
        for s in ["http://127.0.0.1:8080", "http://127.0.0.1:8080/", "http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/v1/"] {
            let client = EdgespecClient(baseURL: URL(string: s)!)
            XCTAssertEqual(client.url("health").absoluteString, "http://127.0.0.1:8080/health")
            XCTAssertEqual(client.url("v1/models").absoluteString, "http://127.0.0.1:8080/v1/models")
        }
    }

    #if os(macOS) || os(Linux)
    func testBanner() {
        XCTAssertEqual(EdgespecServer.parseBanner("edgespec serve: tiny-test on http://127.0.0.1:43210/v1"),
                       URL(string: "http://127.0.0.1:43210"))
        XCTAssertNil(EdgespecServer.parseBanner("INFO: something on http://x"))
        let a = EdgespecServer.randomKey(), b = EdgespecServer.randomKey()
        XCTAssertNotEqual(a, b)
        XCTAssertEqual(a.count, 3 + 64)
    }
    #endif
}
