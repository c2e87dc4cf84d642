// memscope-bpf's stand-ins for the pieces of MindStudio Insight's server framework that
// Insight's memscope module includes (logging, string/number/JSON helpers, the SQLite base
// class, protocol base types, the database manager). Written for this harness, thin: just what
// the compiled memscope sources name, with the behaviour they rely on (see README.md). Every
// header in this folder named like one of Insight's includes this file and nothing else.
#ifndef MEMSCOPE_BPF_INSIGHT_STUBS_H
#define MEMSCOPE_BPF_INSIGHT_STUBS_H

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iostream>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <stack>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include <sqlite3.h>

// rapidjson (a third-party library Insight builds with; Debian: rapidjson-dev).
#include <rapidjson/document.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>
#ifndef RAPIDJSON_DEFAULT_ALLOCATOR  // newer rapidjson names its default allocator; 1.1.0 does not
#define RAPIDJSON_DEFAULT_ALLOCATOR rapidjson::MemoryPoolAllocator<rapidjson::CrtAllocator>
#endif

namespace Dic {

// ---------------------------------------------------------------- logging
namespace Server {
struct ServerLog {
    template <typename... A> static void Info(const A&... a) { Put("INFO", a...); }
    template <typename... A> static void Debug(const A&... a) { Put("DEBUG", a...); }
    template <typename... A> static void Warn(const A&... a) { Put("WARN", a...); }
    template <typename... A> static void Error(const A&... a) { Put("ERROR", a...); }

private:
    template <typename... A> static void Put(const char* level, const A&... a)
    {
        if (std::getenv("INSIGHT_HARNESS_QUIET") != nullptr) {
            return;
        }
        std::vector<std::string> parts;
        (parts.push_back(ToText(a)), ...);
        // Insight's messages put later arguments at each '%' of the first, or after it.
        std::string line = "[insight " + std::string(level) + "] ";
        size_t next = 1;
        for (char c : parts.empty() ? std::string() : parts[0]) {
            if (c == '%' && next < parts.size()) {
                line += parts[next++];
            } else {
                line += c;
            }
        }
        for (; next < parts.size(); ++next) {
            line += parts[next];
        }
        std::cerr << line << '\n';
    }
    template <typename T> static std::string ToText(const T& v)
    {
        std::ostringstream s;
        s << v;
        return s.str();
    }
};
}  // namespace Server

// ---------------------------------------------------------------- string / number helpers
namespace StringUtil {
// Replaces each "{}" in turn by the next argument; "" when the counts differ.
template <typename... A> std::string FormatString(const std::string& fmt, const A&... args)
{
    std::vector<std::string> parts{std::string(std::string_view(args))...};
    std::string out;
    size_t next = 0;
    size_t pos = 0;
    for (;;) {
        size_t hole = fmt.find("{}", pos);
        if (hole == std::string::npos) {
            break;
        }
        if (next == parts.size()) {
            return "";
        }
        out.append(fmt, pos, hole - pos).append(parts[next++]);
        pos = hole + 2;
    }
    if (next != parts.size()) {
        return "";
    }
    return out.append(fmt, pos, std::string::npos);
}
template <typename... A> std::string StrJoin(const A&... parts)
{
    std::string out;
    (out.append(std::string_view(parts)), ...);
    return out;
}
template <size_t N> std::string GenerateColumnString(const std::string_view (&cols)[N])
{
    std::string out;
    for (size_t i = 0; i < N; ++i) {
        out.append(i == 0 ? "" : " ,").append(cols[i]);
    }
    return out;
}
inline std::string CreateQuestionMarkString(uint64_t n)
{
    std::string out;
    for (uint64_t i = 0; i < n; ++i) {
        out.append(i == 0 ? "?" : ",?");
    }
    return out;
}
inline void StripDbColumnName(std::string& name)
{
    if (name.size() > 2 && name.front() == '`' && name.back() == '`') {
        name = name.substr(1, name.size() - 2);
    }
}
inline bool StartWith(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
inline std::string DoubleToStringWithTwoDecimalPlaces(double v)
{
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f", v);
    return buf;
}
inline bool ValidateStringParam(const std::string& s)
{
    return s.find_first_of("|;&$><`\\!\n") == std::string::npos;
}
}  // namespace StringUtil

namespace NumberUtil {
inline uint64_t Int64ToUint64(int64_t v) { return v < 0 ? 0 : static_cast<uint64_t>(v); }
inline unsigned long long StringToUnsignedLongLong(const std::string& s)
{
    try {
        return s.empty() ? 0 : std::stoull(s);
    } catch (const std::exception&) {
        return 0;
    }
}
inline long long StringToLongLong(const std::string& s)
{
    try {
        return s.empty() ? 0 : std::stoll(s);
    } catch (const std::exception&) {
        return 0;
    }
}
}  // namespace NumberUtil

// ---------------------------------------------------------------- JSON (over rapidjson)
using namespace rapidjson;
using json_t = rapidjson::Value;
using document_t = rapidjson::Document;

namespace JsonUtil {
// Adds `key` (copied) with `value`: a string is copied, a JSON value is moved in, a number or
// bool is stored as such.
template <typename T, typename Alloc> void AddMember(json_t& json, std::string_view key, T&& value, Alloc& alloc)
{
    using D = std::decay_t<T>;
    json_t name(key.data(), static_cast<SizeType>(key.size()), alloc);
    if constexpr (std::is_same_v<D, std::string> || std::is_same_v<D, std::string_view>) {
        json.AddMember(name, json_t(value.data(), static_cast<SizeType>(value.size()), alloc), alloc);
    } else if constexpr (std::is_same_v<D, const char*> || std::is_same_v<D, char*>) {
        json.AddMember(name, json_t(value, alloc), alloc);
    } else if constexpr (std::is_base_of_v<json_t, D>) {
        json_t& moved = value;
        json.AddMember(name, moved, alloc);
    } else {
        json.AddMember(name, json_t(value), alloc);
    }
}
template <typename T> void SetByJsonKeyValue(T& dst, const json_t& json, std::string_view key)
{
    std::string k(key);
    if (!json.IsObject() || !json.HasMember(k.c_str())) {
        return;
    }
    const json_t& v = json[k.c_str()];
    if constexpr (std::is_same_v<T, std::string>) {
        if (v.IsString()) {
            dst = v.GetString();
        }
    } else if constexpr (std::is_floating_point_v<T>) {
        if (v.IsNumber()) {
            dst = static_cast<T>(v.GetDouble());
        }
    } else {
        if (v.template Is<T>()) {
            dst = v.template Get<T>();
        }
    }
}
// The member's string; "" when it is absent or not a string.
inline std::string GetString(const json_t& json, std::string_view key)
{
    std::string k(key);
    if (!json.IsObject() || !json.HasMember(k.c_str()) || !json[k.c_str()].IsString()) {
        return "";
    }
    return json[k.c_str()].GetString();
}
inline std::optional<document_t> TryParse(const std::string& text, std::string& error)
{
    document_t doc;
    doc.Parse(text.c_str(), text.size());
    if (doc.HasParseError()) {
        error = "json parse error " + std::to_string(doc.GetParseError()) + " at " +
                std::to_string(doc.GetErrorOffset());
        return std::nullopt;
    }
    return std::optional<document_t>(std::move(doc));
}
inline std::string JsonDump(const json_t& json)
{
    StringBuffer buf;
    Writer<StringBuffer> writer(buf);
    json.Accept(writer);
    return buf.GetString();
}
}  // namespace JsonUtil

// ---------------------------------------------------------------- constants
const int UNKNOW_ERROR = 9999;
const std::string TABLE_LEAKS_DUMP = "leaks_dump";
const std::string TABLE_MEM_SCOPE_DUMP = "memscope_dump";
const std::string FINISH_STATUS = "FINISH";
const std::string NOT_FINISH_STATUS = "NOT_FINISH";
const std::string MEMORY_PREFIX = "[Memory]";

struct TraceIdManager {
    static std::string GetTraceId() { return ""; }
};

// Runs each task at once, on the caller's thread (the harness calls the parse task directly).
class ThreadPool {
public:
    explicit ThreadPool(int) {}
    template <typename F, typename... A> void AddTask(F&& f, const std::string&, A&&... args)
    {
        std::invoke(std::forward<F>(f), std::forward<A>(args)...);
    }
    void Reset() {}
    void ShutDown() {}
};

// ---------------------------------------------------------------- protocol base types
namespace Protocol {
const std::string MODULE_UNKNOWN = "unknown";
const std::string MODULE_MEM_SCOPE = "leaks";
const std::string EVENT_PARSE_MEM_SCOPE_COMPLETED = "parse/leaksMemoryCompleted";
const std::string REQ_RES_MEM_SCOPE_MEMORY_BLOCKS = "Memory/leaks/blocks";
const std::string REQ_RES_MEM_SCOPE_MEMORY_ALLOCATIONS = "Memory/leaks/allocations";
const std::string REQ_RES_MEM_SCOPE_MEMORY_DETAILS = "Memory/leaks/details";
const std::string REQ_RES_MEM_SCOPE_PYTHON_TRACES = "Memory/leaks/traces";
const std::string REQ_RES_MEM_SCOPE_EVENTS = "Memory/leaks/events";

struct Request {
    explicit Request(std::string cmd) : command(std::move(cmd)) {}
    virtual ~Request() = default;
    unsigned int id{0};
    std::string command;
    std::string moduleName;
    std::string projectName;
    std::string fileId;
};
struct Response {
    explicit Response(std::string cmd) : command(std::move(cmd)) {}
    virtual ~Response() = default;
    unsigned int requestId{0};
    std::string command;
    std::string moduleName;
    bool result{false};
    std::string errorMsg;
};
struct JsonResponse : Response {
    using Response::Response;
    [[nodiscard]] virtual std::optional<document_t> ToJson() const = 0;
};
struct Event {
    explicit Event(std::string name) : event(std::move(name)) {}
    virtual ~Event() = default;
    std::string event;
    std::string moduleName;
    bool result{false};
};
struct JsonEvent : Event {
    using Event::Event;
    [[nodiscard]] virtual std::optional<document_t> ToJson() const = 0;
};

class ProtocolUtil {
public:
    virtual ~ProtocolUtil() = default;
    static bool SetRequestBaseInfo(Request& req, const json_t& json)
    {
        JsonUtil::SetByJsonKeyValue(req.id, json, "id");
        JsonUtil::SetByJsonKeyValue(req.moduleName, json, "moduleName");
        return true;
    }
    static void SetResponseJsonBaseInfo(const Response& res, document_t& json)
    {
        auto& a = json.GetAllocator();
        JsonUtil::AddMember(json, "type", "response", a);
        JsonUtil::AddMember(json, "requestId", res.requestId, a);
        JsonUtil::AddMember(json, "command", res.command, a);
        JsonUtil::AddMember(json, "moduleName", res.moduleName, a);
        JsonUtil::AddMember(json, "result", res.result, a);
    }
    static void SetEventJsonBaseInfo(const Event& ev, document_t& json)
    {
        auto& a = json.GetAllocator();
        JsonUtil::AddMember(json, "type", "event", a);
        JsonUtil::AddMember(json, "event", ev.event, a);
        JsonUtil::AddMember(json, "moduleName", ev.moduleName, a);
        JsonUtil::AddMember(json, "result", ev.result, a);
    }

protected:
    virtual void RegisterJsonToRequestFuncs() {}
    virtual void RegisterResponseToJsonFuncs() {}
    virtual void RegisterEventToJsonFuncs() {}
};

inline bool CheckStrParamValid(const std::string& p, std::string& err)
{
    if (p.empty() || p.size() > 500 || !StringUtil::ValidateStringParam(p)) {
        err = "invalid parameter";
        return false;
    }
    return true;
}
inline bool CheckPageValid(int64_t pageSize, int64_t currentPage, std::string& err)
{
    if (pageSize <= 0 || currentPage <= 0) {
        err = "invalid page";
        return false;
    }
    return true;
}

struct TableViewColumn {
    std::string_view name;
    std::string_view key;
    bool visible{true};
    bool sortable{false};
    bool searchable{false};
    bool rangeFilterable{false};
    TableViewColumn(std::string_view n, std::string_view k, bool v, bool s, bool se, bool r)
        : name(n), key(k), visible(v), sortable(s), searchable(se), rangeFilterable(r) {}
    TableViewColumn(std::string_view n, std::string_view k) : name(n), key(k), visible(false) {}
    json_t ToTableHeaderJson(RAPIDJSON_DEFAULT_ALLOCATOR& a) const
    {
        json_t j(kObjectType);
        JsonUtil::AddMember(j, "name", name, a);
        JsonUtil::AddMember(j, "key", key, a);
        return j;
    }
};
struct PaginationParam {
    int64_t currentPage{};
    int64_t pageSize{};
    bool Check(std::string& err) const { return (pageSize == 0 && currentPage == 0) || CheckPageValid(pageSize, currentPage, err); }
    void SetPaginationParamFromJson(const json_t& json)
    {
        JsonUtil::SetByJsonKeyValue(currentPage, json, "currentPage");
        JsonUtil::SetByJsonKeyValue(pageSize, json, "pageSize");
    }
};
// Table filters are not used by the python-trace path: the setters accept nothing.
struct FiltersParam {
    std::map<std::string, std::string> filters;
    bool SetFiltersFromJson(const json_t&, const std::vector<TableViewColumn>&, std::string&) { return true; }
};
struct OrderByParam {
    std::string orderBy;
    bool desc{};
    bool SetOrderFromJson(const json_t&, const std::vector<TableViewColumn>&, std::string&) { return true; }
};
struct RangeFiltersParam {
    std::map<std::string, std::pair<double, double>> rangeFilters;
    bool SetRangeFiltersFromJson(const json_t&, const std::vector<TableViewColumn>&, std::string&) { return true; }
};
}  // namespace Protocol

// Delivered to the harness (main.cpp defines them).
void SendEvent(std::unique_ptr<Protocol::Event> eventPtr);
void SendResponse(std::unique_ptr<Protocol::Response> responsePtr, bool result, const std::string& errorMsg = "",
                  const int errorCode = UNKNOW_ERROR);

namespace Module {
using namespace Dic::Protocol;  // as Insight's request-handler base header does
namespace Memory {}
namespace FullDb {
class MemScopeDatabase;
}

// ---------------------------------------------------------------- SQLite base class
class Database {
public:
    explicit Database(std::recursive_mutex& sqlMutex) : mutex(sqlMutex) {}
    virtual ~Database() { CloseDb(); }
    virtual bool OpenDb(const std::string& dbPath, bool clearAllTable);
    void CloseDb();
    bool ExecSql(const std::string& sql) const;
    bool CheckTableExist(const std::string& table);
    bool CheckTablesExist(const std::vector<std::string>& tables);
    bool CheckColumnExist(const std::string& table, const std::string& column);
    bool IsDatabaseVersionChange() const;
    bool SetDataBaseVersion(const std::string& targetVersion = "");
    bool CheckValueFromStatusInfoTable(const std::string& key, const std::string& refValue);
    bool UpdateValueIntoStatusInfoTable(const std::string& key, const std::string& value);

protected:
    static std::string sqlite3_column_string(sqlite3_stmt* stmt, int col);
    static std::string BuildQueryFiltersConditionSql(const std::map<std::string, std::string>& filters);
    static std::string BuildQueryRangeFiltersConditionSql(
        const std::map<std::string, std::pair<double, double>>& rangeFilters);
    static std::string BuildQueryOrderSql(const std::string& orderBy, bool desc);
    static void CommonBindFiltersParams(const std::map<std::string, std::string>& filters, sqlite3_stmt* stmt,
                                        int& bindIdx);
    static void CommonBindRangeFiltersParams(const std::map<std::string, std::pair<double, double>>& rangeFilters,
                                             sqlite3_stmt* stmt, int& bindIdx);
    static void CommonBindPaginationParams(int64_t pageSize, int64_t currentPage, sqlite3_stmt* stmt, int& bindIdx);

    sqlite3* db = nullptr;
    std::recursive_mutex& mutex;
    bool isOpen = false;
    std::string path;
    const int bindStartIndex = 1;
    const int resultStartIndex = 0;
    const std::string infoTable = "status_info";
};

// ---------------------------------------------------------------- request handler base
class ModuleRequestHandler {
public:
    virtual ~ModuleRequestHandler() = default;
    virtual bool HandleRequest(std::unique_ptr<Protocol::Request> requestPtr) = 0;
    static void SetBaseResponse(const Protocol::Request& req, Protocol::Response& res)
    {
        res.requestId = req.id;
        res.command = req.command;
        res.moduleName = req.moduleName;
    }

protected:
    std::string command;
    std::string error;
    std::string moduleName = Protocol::MODULE_UNKNOWN;
    bool async = true;
};

namespace Timeline {
enum class DatabaseType { MEM_SCOPE };
enum class ParserStatus { INIT, FINISH_ALL };

// One MemScope database, the harness's (main.cpp sets it).
class DataBaseManager {
public:
    static DataBaseManager& Instance()
    {
        static DataBaseManager manager;
        return manager;
    }
    std::shared_ptr<FullDb::MemScopeDatabase> GetMemScopeDatabase(const std::string&) { return memScope; }
    std::vector<FullDb::MemScopeDatabase*> GetAllMemScopeDatabase()
    {
        return memScope ? std::vector<FullDb::MemScopeDatabase*>{memScope.get()}
                        : std::vector<FullDb::MemScopeDatabase*>{};
    }
    void Clear(DatabaseType) { memScope.reset(); }

    std::shared_ptr<FullDb::MemScopeDatabase> memScope;
};

class ParserStatusManager {
public:
    static ParserStatusManager& Instance()
    {
        static ParserStatusManager manager;
        return manager;
    }
    void SetParserStatus(const std::string& fileId, ParserStatus status) { statuses[fileId] = status; }
    void SetFinishStatus(const std::string& fileId) { statuses[fileId] = ParserStatus::FINISH_ALL; }
    std::map<std::string, ParserStatus> statuses;
};
}  // namespace Timeline
}  // namespace Module
}  // namespace Dic

#endif  // MEMSCOPE_BPF_INSIGHT_STUBS_H
