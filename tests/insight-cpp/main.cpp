// insight-harness: runs MindStudio Insight's own memscope server code (compiled from an Insight
// checkout by build.sh) on a memscope-bpf DB, as Insight does when it imports the file and the
// user opens a thread's Python flame graph, and prints what Insight would send the frontend.
//
//   insight-harness [--relative] [--trim] [--response] DB
//
// The DB is copied first (Insight writes into the file it imports) and the copy deleted after.
// Steps, all Insight's code but for the stand-ins in stub/:
//   1. MemScopeParser::ParseMemScopeDbTask(copy): opens the DB (MemScopeDatabase::OpenDb, which
//      adds the Depth column to every python_trace_<pid> table), builds memory blocks and
//      allocations, computes each trace slice's depth per thread (ParseThreadPythonTrace) and
//      writes it, then sends the "parse completed" event with the thread ids.
//   2. For each of those threads, a "Memory/leaks/traces" request built by Insight's
//      MemScopePythonTraceRequest::FromJson and handled by QueryMemScopePythonTraceHandler,
//      whose response (MemScopePythonTracesResponse::ToJson) is what the flame graph draws.
//
// Output, one JSON object a line on stdout (Insight's log goes to stderr; set
// INSIGHT_HARNESS_QUIET=1 to silence it):
//   {"kind":"parsed","event":<Insight's parse-completed event>}
//   {"kind":"slice","tid":T,"func":"...","start":S,"end":E,"depth":D}   one per slice drawn
//   {"kind":"response","json":<Insight's response>}                     with --response
// Times are the DB's ns, or ns since the DB's first event with --relative (as the frontend
// asks). --trim lets Insight merge small slices as it does past 20000 slices.
// Exit: 0 done, 1 usage or I/O, 2 Insight's parse failed, 3 a trace request failed.
#include <unistd.h>

#include <cstring>

#include "DataBaseManager.h"
#include "MemScopeDatabase.h"
#include "MemScopeParser.h"
#include "MemScopeProtocolEvent.h"
#include "MemScopeProtocolRequest.h"
#include "MemScopeProtocolResponse.h"
#include "QueryMemScopePythonTraceHandler.h"

namespace {
std::vector<std::unique_ptr<Dic::Protocol::Event>> g_events;
std::vector<std::pair<std::unique_ptr<Dic::Protocol::Response>, bool>> g_responses;

std::string Dump(const rapidjson::Value& v)
{
    rapidjson::StringBuffer buf;
    rapidjson::Writer<rapidjson::StringBuffer> writer(buf);
    v.Accept(writer);
    return buf.GetString();
}

bool CopyDb(const std::string& from, const std::string& to)
{
    sqlite3* src = nullptr;
    sqlite3* dst = nullptr;
    bool ok = sqlite3_open_v2(from.c_str(), &src, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK &&
              sqlite3_open(to.c_str(), &dst) == SQLITE_OK;
    if (ok) {
        sqlite3_backup* b = sqlite3_backup_init(dst, "main", src, "main");
        ok = b != nullptr && sqlite3_backup_step(b, -1) == SQLITE_DONE;
        sqlite3_backup_finish(b);
    }
    if (!ok) {
        std::cerr << "cannot copy " << from << ": " << (src ? sqlite3_errmsg(src) : "?") << '\n';
    }
    sqlite3_close(src);
    sqlite3_close(dst);
    return ok;
}
}  // namespace

namespace Dic {
void SendEvent(std::unique_ptr<Protocol::Event> eventPtr) { g_events.push_back(std::move(eventPtr)); }
void SendResponse(std::unique_ptr<Protocol::Response> responsePtr, bool result, const std::string& errorMsg, int)
{
    responsePtr->result = result;
    responsePtr->errorMsg = errorMsg;
    g_responses.emplace_back(std::move(responsePtr), result);
}
}  // namespace Dic

int main(int argc, char** argv)
{
    using namespace Dic;
    using namespace Dic::Module;
    bool relative = false;
    bool trim = false;
    bool printResponse = false;
    std::string dbPath;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--relative") {
            relative = true;
        } else if (a == "--trim") {
            trim = true;
        } else if (a == "--response") {
            printResponse = true;
        } else if (!a.empty() && a[0] != '-' && dbPath.empty()) {
            dbPath = a;
        } else {
            std::cerr << "usage: insight-harness [--relative] [--trim] [--response] DB\n";
            return 1;
        }
    }
    if (dbPath.empty()) {
        std::cerr << "usage: insight-harness [--relative] [--trim] [--response] DB\n";
        return 1;
    }
    const char* tmpdir = std::getenv("TMPDIR");
    std::string copy = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/insight-harness-XXXXXX";
    int fd = mkstemp(copy.data());
    if (fd < 0) {
        std::cerr << "mkstemp: " << std::strerror(errno) << '\n';
        return 1;
    }
    close(fd);
    if (!CopyDb(dbPath, copy)) {
        unlink(copy.c_str());
        return 1;
    }

    std::recursive_mutex sqlMutex;
    Timeline::DataBaseManager::Instance().memScope = std::make_shared<FullDb::MemScopeDatabase>(sqlMutex);

    // 1. Insight's import of the file.
    MemScopeParser::ParseMemScopeDbTask(copy);
    int rc = 0;
    const Protocol::MemScopeParseSuccessEvent* parsed = nullptr;
    for (auto& e : g_events) {
        if (auto* p = dynamic_cast<Protocol::MemScopeParseSuccessEvent*>(e.get())) {
            parsed = p;
        }
    }
    if (parsed == nullptr) {
        std::cerr << "Insight sent no parse-completed event\n";
        rc = 2;
    } else {
        auto json = parsed->ToJson();
        std::cout << R"({"kind":"parsed","event":)" << (json ? Dump(*json) : "null") << "}\n";
        if (!parsed->result) {
            rc = 2;
        }
    }

    // 2. The frontend's request for each thread's flame graph.
    if (rc == 0) {
        std::string deviceId = parsed->body.deviceIds.empty() ? "0" : parsed->body.deviceIds.begin()->first;
        std::set<uint64_t> seen;
        for (uint64_t tid : parsed->body.threadIds) {
            if (!seen.insert(tid).second) {
                continue;
            }
            document_t req(kObjectType);
            auto& a = req.GetAllocator();
            json_t params(kObjectType);
            JsonUtil::AddMember(params, "deviceId", deviceId, a);
            JsonUtil::AddMember(params, "threadId", tid, a);
            JsonUtil::AddMember(params, "relativeTime", relative, a);
            JsonUtil::AddMember(params, "allowTrim", trim, a);
            JsonUtil::AddMember(req, "id", static_cast<unsigned>(tid), a);
            JsonUtil::AddMember(req, "moduleName", Protocol::MODULE_MEM_SCOPE, a);
            JsonUtil::AddMember(req, "params", params, a);
            std::string error;
            auto request = Protocol::MemScopePythonTraceRequest::FromJson(req, error);
            if (request == nullptr) {
                std::cerr << "request for thread " << tid << ": " << error << '\n';
                rc = 3;
                continue;
            }
            g_responses.clear();
            MemScope::QueryMemScopePythonTraceHandler().HandleRequest(std::move(request));
            auto* res = g_responses.empty()
                            ? nullptr
                            : dynamic_cast<Protocol::MemScopePythonTracesResponse*>(g_responses.back().first.get());
            if (res == nullptr || !g_responses.back().second) {
                std::cerr << "trace request for thread " << tid << " failed: "
                          << (g_responses.empty() ? "no response" : g_responses.back().first->errorMsg) << '\n';
                rc = 3;
                continue;
            }
            auto json = res->ToJson();
            if (!json) {
                rc = 3;
                continue;
            }
            if (printResponse) {
                std::cout << R"({"kind":"response","json":)" << Dump(*json) << "}\n";
            }
            const json_t& body = (*json)["body"];
            if (!body.HasMember("traces") || !body["traces"].IsArray()) {
                continue;
            }
            for (const auto& s : body["traces"].GetArray()) {
                document_t line(kObjectType);
                auto& la = line.GetAllocator();
                JsonUtil::AddMember(line, "kind", "slice", la);
                JsonUtil::AddMember(line, "tid", tid, la);
                JsonUtil::AddMember(line, "func", std::string(s["func"].GetString()), la);
                JsonUtil::AddMember(line, "start", s["startTimestamp"].GetUint64(), la);
                JsonUtil::AddMember(line, "end", s["endTimestamp"].GetUint64(), la);
                JsonUtil::AddMember(line, "depth", s["depth"].GetInt(), la);
                std::cout << Dump(line) << '\n';
            }
        }
    }
    Timeline::DataBaseManager::Instance().memScope.reset();
    unlink(copy.c_str());
    return rc;
}
